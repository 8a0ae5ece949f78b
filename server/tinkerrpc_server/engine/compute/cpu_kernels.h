// What the engine's CPU kernels share (cpu_kernels.cpp, decode_attention.cpp, panel_matmul.cpp,
// decode_step.cpp): torch's float vector, the size below which a kernel stays on the calling thread, a dot
// product, the check every kernel makes of its tensors, and the kernels one file composes from another's.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

namespace tinkerrpc_kernels {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kLanes = Vec::size();
// Below this many floats of work a kernel runs on the calling thread: waking the pool costs more.
constexpr int64_t kParallelFloats = 1 << 15;

inline float dot(const float* a, const float* b, int64_t n) {
  // Two accumulators: half the chain of dependent fused multiply-adds.
  Vec even(0.f), odd(0.f);
  int64_t i = 0;
  for (; i + 2 * kLanes <= n; i += 2 * kLanes) {
    even = at::vec::fmadd(Vec::loadu(a + i), Vec::loadu(b + i), even);
    odd = at::vec::fmadd(Vec::loadu(a + i + kLanes), Vec::loadu(b + i + kLanes), odd);
  }
  for (; i + kLanes <= n; i += kLanes) {
    even = at::vec::fmadd(Vec::loadu(a + i), Vec::loadu(b + i), even);
  }
  Vec both = even + odd;
  float sum = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, both);
  for (; i < n; ++i) {
    sum += a[i] * b[i];
  }
  return sum;
}

inline void check_float_cpu(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat, name, " must be a float32 CPU tensor");
}

// cpu_kernels.cpp's, which panel_matmul.cpp composes with its matmul into a decoder layer's two calls: the
// kernels, and their arithmetic one row at a time, which those calls run inside their matmuls' parallel
// regions.
//
// x (tokens, hidden), contiguous: rows(r, out) adds delta's row r (when given) into x's in place, then
// writes x's row r RMS-normalized times weight into out (hidden floats) and returns out. Holds its tensors
// (delta as a contiguous copy) for as long as rows are made.
class AddedAndNormedRows {
 public:
  AddedAndNormedRows(at::Tensor x, const std::optional<at::Tensor>& delta, at::Tensor weight, double eps);
  const float* operator()(int64_t r, float* out) const;

 private:
  at::Tensor x_, delta_, weight_;
  double eps_;
  int64_t hidden_;
};
// silu(gate) · up, width floats of each, into out.
void silu_and_multiply_row(const float* gate, const float* up, float* out, int64_t width);
at::Tensor residual_rms_norm(at::Tensor x, const std::optional<at::Tensor>& delta, const at::Tensor& weight,
                             double eps);
at::Tensor silu_and_multiply(const at::Tensor& gate_up);
at::Tensor rotary_qk(const at::Tensor& qk, const at::Tensor& cos, const at::Tensor& signed_sin,
                     const std::optional<at::Tensor>& norm_weight, double eps);
// decode_attention.cpp's and panel_matmul.cpp's (AVX2 and AVX-512 builds), which decode_step.cpp runs layer
// after layer.
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& bias,
                            double scale, int64_t shared_begin, int64_t shared_end);
at::Tensor decoder_qkv(at::Tensor x, const std::optional<at::Tensor>& delta, const at::Tensor& norm_weight,
                       double eps, const at::Tensor& qkv, int64_t qkv_features);
at::Tensor decoder_mlp(at::Tensor x, const at::Tensor& attended, const at::Tensor& o, int64_t o_features,
                       const at::Tensor& norm_weight, double eps, const at::Tensor& gate_up,
                       int64_t gate_up_features, const at::Tensor& down, int64_t down_features);

}  // namespace tinkerrpc_kernels
