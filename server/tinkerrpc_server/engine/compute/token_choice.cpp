// A decode step's token choice as one CPU kernel (see cpu_kernels.cpp; token_choice.py defines it): each
// row's draw from softmax(logits / T) by its uniform, without top-k/top-p, and the token's logprob. torch's
// ~15 ops over the whole vocabulary took ~0.75 ms of a ~17 ms one-row SmolLM2 step.
#include "cpu_kernels.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>
#include <vector>

namespace tinkerrpc_kernels {

// logits (rows, vocab) with contiguous rows; scales (rows): the temperature, 1 for greedy rows; greedy
// (rows, bool); uniforms (rows) in [0, 1). Per row, the first index whose cumulative exp(logits / scale -
// peak) exceeds uniform × the total (found block by block, `block` positions each), or the first argmax
// for a greedy row; its logprob log-softmax(logits / scale) there; the peak and log of the total (for
// token_choice.py's top-k/top-p rows). Returns (tokens int64, logprobs, peaks, log_totals).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> choose_tokens(const at::Tensor& logits,
                                                                         const at::Tensor& scales,
                                                                         const at::Tensor& greedy,
                                                                         const at::Tensor& uniforms, int64_t block) {
  check_float_cpu(logits, "logits");
  check_float_cpu(scales, "scales");
  check_float_cpu(uniforms, "uniforms");
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1 && logits.size(1) > 0, "logits must be (rows, vocab) rows");
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  TORCH_CHECK(scales.numel() == rows && uniforms.numel() == rows && greedy.numel() == rows &&
                  greedy.scalar_type() == at::kBool && greedy.device().is_cpu(),
              "scales, greedy and uniforms must hold one value per row");
  TORCH_CHECK(block > 0, "block must be positive");
  const at::Tensor scale_of = scales.contiguous(), uniform_of = uniforms.contiguous(), greedy_of = greedy.contiguous();
  at::Tensor tokens = at::empty({rows}, logits.options().dtype(at::kLong));
  at::Tensor logprobs = at::empty({rows}, logits.options());
  at::Tensor peaks = at::empty({rows}, logits.options());
  at::Tensor log_totals = at::empty({rows}, logits.options());
  const float* ls = logits.data_ptr<float>();
  const int64_t row_stride = logits.stride(0);
  const float* ss = scale_of.data_ptr<float>();
  const float* us = uniform_of.data_ptr<float>();
  const bool* gs = greedy_of.data_ptr<bool>();
  int64_t* ts = tokens.data_ptr<int64_t>();
  float *lps = logprobs.data_ptr<float>(), *ps = peaks.data_ptr<float>(), *lts = log_totals.data_ptr<float>();
  const int64_t blocks = (vocab + block - 1) / block;
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scaled(vocab), weights(block);
    std::vector<double> block_sums(blocks);
    for (int64_t r = begin; r < end; ++r) {
      const float* l = ls + r * row_stride;
      const float scale = ss[r];
      // As torch divides: logits / T, exactly the logits where T is 1.
      Vec peak_lanes(-std::numeric_limits<float>::infinity());
      const Vec scale_vec(scale);
      int64_t i = 0;
      for (; i + kLanes <= vocab; i += kLanes) {
        const Vec s = Vec::loadu(l + i) / scale_vec;
        s.store(scaled.data() + i);
        peak_lanes = at::vec::maximum(peak_lanes, s);
      }
      float peak = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return at::vec::maximum(x, y); }, peak_lanes);
      for (; i < vocab; ++i) {
        scaled[i] = l[i] / scale;
        peak = std::max(peak, scaled[i]);
      }
      // exp(scaled - peak) summed per block, in float lanes, each block's sum then kept in double.
      const Vec peak_vec(peak);
      double total = 0.0;
      for (int64_t b = 0; b < blocks; ++b) {
        const int64_t first = b * block, last = std::min(vocab, first + block);
        Vec lanes(0.f);
        int64_t j = first;
        for (; j + kLanes <= last; j += kLanes) {
          lanes = lanes + (Vec::loadu(scaled.data() + j) - peak_vec).exp();
        }
        double sum = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, lanes);
        for (; j < last; ++j) {
          sum += std::exp(scaled[j] - peak);
        }
        block_sums[b] = sum;
        total += sum;
      }
      int64_t token = 0;
      if (gs[r]) {
        token = std::max_element(l, l + vocab) - l;  // the first of equal maxima, as torch.argmax
      } else {
        // The block the draw lands in, then the position inside it; a draw at the very top (rounding)
        // takes the last position.
        const double target = static_cast<double>(us[r]) * total;
        double before = 0.0;
        int64_t b = 0;
        while (b + 1 < blocks && before + block_sums[b] <= target) {
          before += block_sums[b++];
        }
        const int64_t first = b * block, last = std::min(vocab, first + block);
        int64_t j = first;
        for (; j + kLanes <= last; j += kLanes) {  // the block's weights as its sum computed them
          (Vec::loadu(scaled.data() + j) - peak_vec).exp().store(weights.data() + (j - first));
        }
        for (; j < last; ++j) {
          weights[j - first] = std::exp(scaled[j] - peak);
        }
        token = last - 1;
        double running = before;
        for (j = first; j < last; ++j) {
          running += weights[j - first];
          if (running > target) {
            token = j;
            break;
          }
        }
      }
      const float log_total = static_cast<float>(std::log(total));
      ts[r] = token;
      ps[r] = peak;
      lts[r] = log_total;
      lps[r] = scaled[token] - peak - log_total;
    }
  });
  return {tokens, logprobs, peaks, log_totals};
}

}  // namespace tinkerrpc_kernels

TORCH_LIBRARY_IMPL(tinkerrpc_cpu, CPU, m) { m.impl("choose_tokens", tinkerrpc_kernels::choose_tokens); }
