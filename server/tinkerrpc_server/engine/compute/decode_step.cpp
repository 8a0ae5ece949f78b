// A decode step's decoder layers on the panel kernel as one call (see cpu_kernels.cpp): layer after layer,
// the same kernels the per-layer path calls from Python, in the same order, with each layer's new key and
// value written into the column the caller's cache left for them. At one row of SmolLM2 the per-layer
// path's ~9 trips through Python and the dispatcher were ~2 ms of a ~20 ms step.
#include "cpu_kernels.h"

#include <algorithm>
#include <vector>

#ifdef __AVX2__
namespace tinkerrpc_kernels {
namespace {

// cache[:, :, column] = rows (rows, kv heads, dim), a head's dim floats at a time: a few microseconds less
// per layer than Tensor::copy_ (its TensorIterator set-up, for a few KiB).
void write_column(const at::Tensor& cache, int64_t column, const at::Tensor& rows) {
  TORCH_CHECK(cache.stride(3) == 1 && rows.stride(2) == 1 && rows.size(0) == cache.size(0) &&
                  rows.size(1) == cache.size(1) && rows.size(2) == cache.size(3),
              "a cache column and its rows must be (rows, kv heads, dim) with contiguous dim");
  const int64_t dim = cache.size(3);
  float* to = cache.data_ptr<float>() + column * cache.stride(2);
  const float* from = rows.data_ptr<float>();
  for (int64_t r = 0; r < rows.size(0); ++r) {
    for (int64_t h = 0; h < rows.size(1); ++h) {
      const float* head = from + r * rows.stride(0) + h * rows.stride(1);
      std::copy(head, head + dim, to + r * cache.stride(0) + h * cache.stride(1));
    }
  }
}

}  // namespace

// x (rows, hidden), contiguous: one token per row, its embedding; updated in place as the residual stream.
// weights: per layer, input norm, q/k/v, o, post-attention norm, gate/up, down (the four projections packed
// by pack_linear_weight, with out features `features`, the same in every layer); qk_norms: per layer, the
// q/k norm weight, or none at all. cos, signed_sin (rows, dim): the rows' rotary. keys, values: per layer,
// (rows, kv heads, columns, dim) views of the cache whose last column is this step's, written here.
// bias (rows, columns): 0, or -inf at padding. Returns the last layer's output (x plus its MLP's).
at::Tensor decode_layers(at::Tensor x, at::TensorList weights, at::TensorList qk_norms, at::IntArrayRef features,
                         const at::Tensor& cos, const at::Tensor& signed_sin, at::TensorList keys,
                         at::TensorList values, const at::Tensor& bias, double scale, int64_t shared_begin,
                         int64_t shared_end, int64_t heads, double eps) {
  constexpr size_t kPerLayer = 6;
  const size_t layers = keys.size();
  TORCH_CHECK(weights.size() == kPerLayer * layers && values.size() == layers, "weights, keys and values disagree on the layers");
  TORCH_CHECK(qk_norms.empty() || qk_norms.size() == layers, "qk_norms must be empty or one per layer");
  TORCH_CHECK(features.size() == 4, "features: q/k/v, o, gate/up and down out features");
  TORCH_CHECK(heads > 0, "heads must be positive");
  check_float_cpu(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be (rows, hidden), contiguous");
  const int64_t rows = x.size(0);
  std::optional<at::Tensor> residual;
  for (size_t layer = 0; layer < layers; ++layer) {
    const at::Tensor* w = weights.data() + kPerLayer * layer;
    const at::Tensor& layer_keys = keys[layer];
    const at::Tensor& layer_values = values[layer];
    TORCH_CHECK(layer_keys.dim() == 4 && layer_keys.size(0) == rows && layer_keys.size(2) > 0 &&
                    layer_values.sizes() == layer_keys.sizes(),
                "keys and values must be (rows, kv heads, columns, dim), this step's column last");
    const int64_t kv_heads = layer_keys.size(1), column = layer_keys.size(2) - 1, dim = layer_keys.size(3);
    const int64_t qk_width = (heads + kv_heads) * dim;
    const at::Tensor qkv = decoder_qkv(x, residual, w[0], eps, w[1], features[0]);
    std::optional<at::Tensor> qk_norm;
    if (!qk_norms.empty()) {
      qk_norm = qk_norms[layer];
    }
    const at::Tensor qk = rotary_qk(qkv.narrow(1, 0, qk_width).view({rows, heads + kv_heads, dim}), cos,
                                    signed_sin, qk_norm, eps);
    write_column(layer_keys, column, qk.narrow(1, heads, kv_heads));
    write_column(layer_values, column, qkv.narrow(1, qk_width, kv_heads * dim).view({rows, kv_heads, dim}));
    const at::Tensor attended =
        decode_attention(qk.narrow(1, 0, heads), layer_keys, layer_values, bias, scale, shared_begin, shared_end);
    residual = decoder_mlp(x, attended, w[2], features[1], w[3], eps, w[4], features[2], w[5], features[3]);
  }
  return residual.has_value() ? x + *residual : x;
}

// Each layer's cache view (rows, kv heads, columns, dim) grown by one column for a decode step of `rows` rows
// inside its buffer: buffer[:rows, :, :columns + 1], as kv_cache.py's per-layer growth makes it where the
// buffer has the room. One call for every layer of a step: that growth in Python, two views per layer, took
// ~0.5 ms of a ~19 ms one-row SmolLM2 step, its interpreter and allocator state evicted from the caches by
// the step's weights. Empty where any layer's view is not the leading part of its buffer (same strides and
// data), or its buffer lacks the rows, the column or the `heads`: the caller then grows layer by layer.
std::vector<at::Tensor> grown_views(at::TensorList views, at::TensorList buffers, int64_t rows, int64_t heads) {
  TORCH_CHECK(views.size() == buffers.size(), "one buffer per view");
  TORCH_CHECK(rows > 0 && heads > 0, "rows and heads must be positive");
  std::vector<at::Tensor> grown;
  grown.reserve(views.size());
  for (size_t layer = 0; layer < views.size(); ++layer) {
    const at::Tensor& view = views[layer];
    const at::Tensor& buffer = buffers[layer];
    if (view.dim() != 4 || buffer.dim() != 4 || view.data_ptr() != buffer.data_ptr() ||
        view.strides() != buffer.strides() || buffer.size(0) < rows || buffer.size(1) != heads ||
        buffer.size(2) < view.size(2) + 1) {
      return {};
    }
    grown.push_back(buffer.narrow(0, 0, rows).narrow(2, 0, view.size(2) + 1));
  }
  return grown;
}

}  // namespace tinkerrpc_kernels

TORCH_LIBRARY_IMPL(tinkerrpc_cpu, CPU, m) {
  m.impl("decode_layers", tinkerrpc_kernels::decode_layers);
  m.impl("grown_views", tinkerrpc_kernels::grown_views);
}
#endif  // __AVX2__
