// The sampler's element-wise stretches of a decoder layer as single CPU kernels, float32 only.
// A decode step of a small model is ~30 torch ops per layer around its four matmuls; each op pays the
// dispatcher, an allocation and a pass over memory. These kernels do the same arithmetic in one pass:
// the residual add with the RMSNorm after it, the gated activation, and a decode step's attention
// (q/k norm, rotary, and softmax(q·kᵀ·scale + bias)·v over the KV cache, grouped-query, reading the
// columns every row shares once: decode_attention.cpp); and, on AVX2 and AVX-512 CPUs, the sampler's
// float32 matmul by a weight packed into column panels and a decoder layer as two calls around its
// attention (panel_matmul.cpp, `python -m bench.matmul_kernels`).
// A decode step's layers are one call (decode_step.cpp), and so is its token choice (token_choice.cpp).
// engine/compute/cpu_kernels.py builds the five files into one library with g++; tests/engine_core/
// test_cpu_kernels.py and test_token_choice.py check each kernel against the ops or calls it replaces.
#include "cpu_kernels.h"

#include <cmath>
#include <vector>

namespace tinkerrpc_kernels {

// out = x * inv * weight, as transformers' RMSNorm scales (normalized first, then the weight).
void scale_row(const float* x, float inv, const float* weight, float* out, int64_t n) {
  const Vec inv_vec(inv);
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    (Vec::loadu(x + i) * inv_vec * Vec::loadu(weight + i)).store(out + i);
  }
  for (; i < n; ++i) {
    out[i] = x[i] * inv * weight[i];
  }
}

float inverse_rms(const float* x, int64_t n, double eps) {
  return 1.f / std::sqrt(dot(x, x, n) / static_cast<float>(n) + static_cast<float>(eps));
}

AddedAndNormedRows::AddedAndNormedRows(at::Tensor x, const std::optional<at::Tensor>& delta, at::Tensor weight,
                                       double eps)
    : x_(std::move(x)), weight_(std::move(weight)), eps_(eps) {
  check_float_cpu(x_, "x");
  check_float_cpu(weight_, "weight");
  TORCH_CHECK(x_.dim() == 2 && x_.is_contiguous(), "x must be (tokens, hidden) and contiguous");
  hidden_ = x_.size(1);
  TORCH_CHECK(weight_.is_contiguous() && weight_.numel() == hidden_, "weight must hold `hidden` floats");
  if (delta.has_value()) {
    check_float_cpu(*delta, "delta");
    TORCH_CHECK(delta->sizes() == x_.sizes(), "delta must match x");
    delta_ = delta->contiguous();
  }
}

const float* AddedAndNormedRows::operator()(int64_t r, float* out) const {
  float* row = x_.data_ptr<float>() + r * hidden_;
  if (delta_.defined()) {
    const float* add = delta_.data_ptr<float>() + r * hidden_;
    int64_t i = 0;
    for (; i + kLanes <= hidden_; i += kLanes) {
      (Vec::loadu(row + i) + Vec::loadu(add + i)).store(row + i);
    }
    for (; i < hidden_; ++i) {
      row[i] += add[i];
    }
  }
  scale_row(row, inverse_rms(row, hidden_, eps_), weight_.data_ptr<float>(), out, hidden_);
  return out;
}

// x += delta (when given), in place; returns rms_norm(x) · weight. x: (tokens, hidden) contiguous.
at::Tensor residual_rms_norm(at::Tensor x, const std::optional<at::Tensor>& delta, const at::Tensor& weight,
                             double eps) {
  const AddedAndNormedRows rows(x, delta, weight, eps);
  const int64_t tokens = x.size(0), hidden = x.size(1);
  at::Tensor out = at::empty_like(x);
  float* os = out.data_ptr<float>();
  at::parallel_for(0, tokens, std::max<int64_t>(1, kParallelFloats / hidden), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      rows(t, os + t * hidden);
    }
  });
  return out;
}

void silu_and_multiply_row(const float* gate, const float* up, float* out, int64_t width) {
  const Vec one(1.f);
  int64_t i = 0;
  for (; i + kLanes <= width; i += kLanes) {
    const Vec g = Vec::loadu(gate + i);
    // torch's silu: x / (1 + exp(-x)).
    (g / (one + g.neg().exp()) * Vec::loadu(up + i)).store(out + i);
  }
  for (; i < width; ++i) {
    out[i] = gate[i] / (1.f + std::exp(-gate[i])) * up[i];
  }
}

// silu(gate) · up for gate_up (tokens, 2·width): the gate in its first `width` columns.
at::Tensor silu_and_multiply(const at::Tensor& gate_up) {
  check_float_cpu(gate_up, "gate_up");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.stride(1) == 1 && gate_up.size(1) % 2 == 0,
              "gate_up must be (tokens, 2 · width) with contiguous rows");
  const int64_t tokens = gate_up.size(0), width = gate_up.size(1) / 2, stride = gate_up.stride(0);
  at::Tensor out = at::empty({tokens, width}, gate_up.options());
  const float* in = gate_up.data_ptr<float>();
  float* os = out.data_ptr<float>();
  at::parallel_for(0, tokens, std::max<int64_t>(1, kParallelFloats / width), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      silu_and_multiply_row(in + t * stride, in + t * stride + width, os + t * width, width);
    }
  });
  return out;
}

// q and k of one decode step, ready for attention: qk (tokens, heads + kv heads, dim), rows of a
// (tokens, ...) view; each head optionally RMS-normalized with its own weight row (q/k norm), then
// rotated: x·cos + roll(x, dim/2)·signed_sin. Returns (tokens, heads + kv heads, dim), contiguous.
at::Tensor rotary_qk(const at::Tensor& qk, const at::Tensor& cos, const at::Tensor& signed_sin,
                     const std::optional<at::Tensor>& norm_weight, double eps) {
  check_float_cpu(qk, "qk");
  check_float_cpu(cos, "cos");
  check_float_cpu(signed_sin, "signed_sin");
  TORCH_CHECK(qk.dim() == 3 && qk.stride(2) == 1 && qk.stride(1) == qk.size(2), "qk must be (tokens, heads, dim) rows");
  const int64_t tokens = qk.size(0), heads = qk.size(1), dim = qk.size(2), half = dim / 2;
  TORCH_CHECK(dim % 2 == 0, "head dim must be even");
  TORCH_CHECK(cos.is_contiguous() && signed_sin.is_contiguous() && cos.numel() == tokens * dim &&
                  signed_sin.numel() == tokens * dim,
              "cos and signed_sin must be (tokens, dim) and contiguous");
  const float* norm = nullptr;
  if (norm_weight.has_value()) {
    check_float_cpu(*norm_weight, "norm_weight");
    TORCH_CHECK(norm_weight->is_contiguous() && norm_weight->numel() == heads * dim, "norm_weight must be (heads, dim)");
    norm = norm_weight->data_ptr<float>();
  }
  at::Tensor out = at::empty({tokens, heads, dim}, qk.options());
  const float* in = qk.data_ptr<float>();
  const float* cs = cos.data_ptr<float>();
  const float* ss = signed_sin.data_ptr<float>();
  float* os = out.data_ptr<float>();
  const int64_t row_stride = qk.stride(0);
  at::parallel_for(0, tokens, std::max<int64_t>(1, kParallelFloats / (heads * dim)), [&](int64_t begin, int64_t end) {
    std::vector<float> normed(dim);
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cs + t * dim;
      const float* s = ss + t * dim;
      for (int64_t h = 0; h < heads; ++h) {
        const float* x = in + t * row_stride + h * dim;
        if (norm != nullptr) {
          scale_row(x, inverse_rms(x, dim, eps), norm + h * dim, normed.data(), dim);
          x = normed.data();
        }
        float* o = os + (t * heads + h) * dim;
        for (int64_t i = 0; i < dim; ++i) {
          const int64_t rolled = i < half ? i + half : i - half;
          o[i] = x[i] * c[i] + x[rolled] * s[i];
        }
      }
    }
  });
  return out;
}

}  // namespace tinkerrpc_kernels

using namespace tinkerrpc_kernels;

TORCH_LIBRARY(tinkerrpc_cpu, m) {
  m.def("residual_rms_norm(Tensor(a!) x, Tensor? delta, Tensor weight, float eps) -> Tensor");
  m.def("silu_and_multiply(Tensor gate_up) -> Tensor");
  m.def("rotary_qk(Tensor qk, Tensor cos, Tensor signed_sin, Tensor? norm_weight, float eps) -> Tensor");
  m.def("pack_linear_weight_into(Tensor weight, Tensor(a!) packed) -> ()");
  m.def("pack_linear_weight(Tensor weight) -> Tensor");
  m.def("packed_linear(Tensor x, Tensor packed, int out_features) -> Tensor");
  m.def(
      "decoder_qkv(Tensor(a!) x, Tensor? delta, Tensor norm_weight, float eps, Tensor qkv, int qkv_features)"
      " -> Tensor");
  m.def(
      "decoder_mlp(Tensor(a!) x, Tensor attended, Tensor o, int o_features, Tensor norm_weight, float eps,"
      " Tensor gate_up, int gate_up_features, Tensor down, int down_features) -> Tensor");
  m.def(
      "decode_attention(Tensor q, Tensor k, Tensor v, Tensor bias, float scale, int shared_begin, int shared_end)"
      " -> Tensor");
  m.def(
      "decode_layers(Tensor(a!) x, Tensor[] weights, Tensor[] qk_norms, int[] features, Tensor cos,"
      " Tensor signed_sin, Tensor(b!)[] keys, Tensor(c!)[] values, Tensor bias, float scale, int shared_begin,"
      " int shared_end, int heads, float eps) -> Tensor");
  m.def("grown_views(Tensor[] views, Tensor(a)[] buffers, int rows, int heads) -> Tensor(a)[]");
  m.def(
      "choose_tokens(Tensor logits, Tensor scales, Tensor greedy, Tensor uniforms, int block)"
      " -> (Tensor, Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(tinkerrpc_cpu, CPU, m) {
  m.impl("residual_rms_norm", residual_rms_norm);
  m.impl("silu_and_multiply", silu_and_multiply);
  m.impl("rotary_qk", rotary_qk);
}
