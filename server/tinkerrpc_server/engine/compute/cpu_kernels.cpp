// The sampler's element-wise stretches of a decoder layer as single CPU kernels, float32 only.
// A decode step of a small model is ~30 torch ops per layer around its four matmuls; each op pays the
// dispatcher, an allocation and a pass over memory. These kernels do the same arithmetic in one pass:
// the residual add with the RMSNorm after it, the gated activation, and a decode step's attention
// (q/k norm, rotary, and softmax(q·kᵀ·scale + bias)·v over the KV cache, grouped-query, reading the
// columns every row shares once); and, on AVX2 and AVX-512 CPUs, the sampler's float32 matmul by a weight
// packed into column panels (`python -m bench.matmul_kernels`). engine/compute/cpu_kernels.py builds this
// file with g++ and checks it against the torch ops it replaces (tests/engine_core/test_cpu_kernels.py).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <utility>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kLanes = Vec::size();
// Below this many floats of work a kernel runs on the calling thread: waking the pool costs more.
constexpr int64_t kParallelFloats = 1 << 15;

float dot(const float* a, const float* b, int64_t n) {
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

#ifdef __AVX2__
// Lane j: the sum of the 8 floats of s[j], each summed in one order, ((0+1)+(2+3))+((4+5)+(6+7)), whichever
// j: a block of 8 dot products costs one such reduction instead of 8.
inline __m256 sum_each(const __m256* s) {
  const __m256 low_pairs = _mm256_hadd_ps(_mm256_hadd_ps(s[0], s[1]), _mm256_hadd_ps(s[2], s[3]));
  const __m256 high_pairs = _mm256_hadd_ps(_mm256_hadd_ps(s[4], s[5]), _mm256_hadd_ps(s[6], s[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(low_pairs, high_pairs, 0x20),
                       _mm256_permute2f128_ps(low_pairs, high_pairs, 0x31));
}
#endif

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

void check_float_cpu(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat, name, " must be a float32 CPU tensor");
}

// x += delta (when given), in place; returns rms_norm(x) · weight. x: (tokens, hidden) contiguous.
at::Tensor residual_rms_norm(at::Tensor x, const std::optional<at::Tensor>& delta, const at::Tensor& weight,
                             double eps) {
  check_float_cpu(x, "x");
  check_float_cpu(weight, "weight");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be (tokens, hidden) and contiguous");
  const int64_t tokens = x.size(0), hidden = x.size(1);
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == hidden, "weight must hold `hidden` floats");
  at::Tensor delta_c;
  if (delta.has_value()) {
    check_float_cpu(*delta, "delta");
    TORCH_CHECK(delta->sizes() == x.sizes(), "delta must match x");
    delta_c = delta->contiguous();
  }
  at::Tensor out = at::empty_like(x);
  float* xs = x.data_ptr<float>();
  const float* ds = delta_c.defined() ? delta_c.data_ptr<float>() : nullptr;
  const float* ws = weight.data_ptr<float>();
  float* os = out.data_ptr<float>();
  at::parallel_for(0, tokens, std::max<int64_t>(1, kParallelFloats / hidden), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      float* row = xs + t * hidden;
      if (ds != nullptr) {
        const float* add = ds + t * hidden;
        int64_t i = 0;
        for (; i + kLanes <= hidden; i += kLanes) {
          (Vec::loadu(row + i) + Vec::loadu(add + i)).store(row + i);
        }
        for (; i < hidden; ++i) {
          row[i] += add[i];
        }
      }
      scale_row(row, inverse_rms(row, hidden, eps), ws, os + t * hidden, hidden);
    }
  });
  return out;
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
  const Vec one(1.f);
  at::parallel_for(0, tokens, std::max<int64_t>(1, kParallelFloats / width), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* gate = in + t * stride;
      const float* up = gate + width;
      float* row = os + t * width;
      int64_t i = 0;
      for (; i + kLanes <= width; i += kLanes) {
        const Vec g = Vec::loadu(gate + i);
        // torch's silu: x / (1 + exp(-x)).
        (g / (one + g.neg().exp()) * Vec::loadu(up + i)).store(row + i);
      }
      for (; i < width; ++i) {
        row[i] = gate[i] / (1.f + std::exp(-gate[i])) * up[i];
      }
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

// One query per row: out[r, h] = softmax(q[r, h]·k[r, h/groups]ᵀ·scale + bias[r]) · v[r, h/groups].
// q (rows, heads, dim) with contiguous head rows; k, v (rows, kv heads, columns, dim) with contiguous
// head-dim rows (views of the cache's buffers); bias (rows, columns): 0, or -inf where a column is
// padding (skipped, not read). Columns [shared_begin, shared_end) hold the same keys and values in
// every row (the samples of one prompt): they are read from row 0. Returns (rows, heads · dim).
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& bias,
                            double scale, int64_t shared_begin, int64_t shared_end) {
  for (const auto& [t, name] : {std::pair{&q, "q"}, {&k, "k"}, {&v, "v"}, {&bias, "bias"}}) {
    check_float_cpu(*t, name);
  }
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "q must be (rows, heads, dim)");
  TORCH_CHECK(k.dim() == 4 && v.sizes() == k.sizes() && k.stride(3) == 1 && v.stride(3) == 1,
              "k and v must be (rows, kv heads, columns, dim) with contiguous dim");
  const int64_t rows = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t kv_heads = k.size(1), columns = k.size(2);
  TORCH_CHECK(k.size(0) == rows && k.size(3) == dim && kv_heads > 0 && heads % kv_heads == 0,
              "k must be (rows, kv heads, columns, dim) with kv heads dividing heads");
  TORCH_CHECK(bias.dim() == 2 && bias.is_contiguous() && bias.size(0) == rows && bias.size(1) == columns,
              "bias must be (rows, columns) and contiguous");
  TORCH_CHECK(0 <= shared_begin && shared_begin <= shared_end && shared_end <= columns, "bad shared columns");
  const int64_t groups = heads / kv_heads;
  at::Tensor out = at::empty({rows, heads * dim}, q.options());
  const float* qs = q.data_ptr<float>();
  const float* ks = k.data_ptr<float>();
  const float* vs = v.data_ptr<float>();
  const float* bs = bias.data_ptr<float>();
  float* os = out.data_ptr<float>();
  const float scale_f = static_cast<float>(scale);
  const float minus_inf = -std::numeric_limits<float>::infinity();
  const int64_t k_strides[3] = {k.stride(0), k.stride(1), k.stride(2)};
  const int64_t v_strides[3] = {v.stride(0), v.stride(1), v.stride(2)};
  const int64_t q_row = q.stride(0), q_head = q.stride(1);
  const int64_t units = rows * kv_heads;
  const int64_t unit_floats = std::max<int64_t>(1, 2 * columns * dim);
  at::parallel_for(0, units, std::max<int64_t>(1, kParallelFloats / unit_floats), [&](int64_t begin, int64_t end) {
    std::vector<float> weights(groups * columns);
    std::vector<const float*> value_columns(columns);
    for (int64_t unit = begin; unit < end; ++unit) {
      const int64_t r = unit / kv_heads, kvh = unit % kv_heads;
      const float* row_bias = bs + r * columns;
      auto column = [&](const float* base, const int64_t* strides, int64_t c) {
        const int64_t source = (c >= shared_begin && c < shared_end) ? 0 : r;
        return base + source * strides[0] + kvh * strides[1] + c * strides[2];
      };
      for (int64_t c = 0; c < columns; ++c) {
        value_columns[c] = column(vs, v_strides, c);
      }
      int64_t scored = 0;
#ifdef __AVX2__
      // 8 columns at a time: their keys' dot products with a query, reduced together, each column's in
      // the same order wherever it falls in a block, so a row's scores do not depend on the batch's
      // padding (a padding column's product is computed, whatever is there, and dropped; a
      // last block short of 8 repeats its last column).
      for (; dim % 8 == 0 && scored < columns; scored += 8) {
        const int64_t block = std::min<int64_t>(8, columns - scored);
        const float* keys[8];
        for (int j = 0; j < 8; ++j) {
          keys[j] = column(ks, k_strides, scored + std::min<int64_t>(j, block - 1));
        }
        for (int64_t g = 0; g < groups; ++g) {
          const float* qg = qs + r * q_row + (kvh * groups + g) * q_head;
          __m256 sums[8];
          for (auto& sum : sums) {
            sum = _mm256_setzero_ps();
          }
          for (int64_t i = 0; i < dim; i += 8) {
            const __m256 qi = _mm256_loadu_ps(qg + i);
            for (int j = 0; j < 8; ++j) {
              sums[j] = _mm256_fmadd_ps(qi, _mm256_loadu_ps(keys[j] + i), sums[j]);
            }
          }
          float products[8];
          _mm256_storeu_ps(products, sum_each(sums));
          for (int j = 0; j < block; ++j) {
            const float b = row_bias[scored + j];
            weights[g * columns + scored + j] = b == minus_inf ? minus_inf : products[j] * scale_f + b;
          }
        }
      }
#endif
      for (int64_t c = scored; c < columns; ++c) {
        if (row_bias[c] == minus_inf) {
          for (int64_t g = 0; g < groups; ++g) {
            weights[g * columns + c] = minus_inf;
          }
          continue;
        }
        const float* kc = column(ks, k_strides, c);
        for (int64_t g = 0; g < groups; ++g) {
          const float* qg = qs + r * q_row + (kvh * groups + g) * q_head;
          weights[g * columns + c] = dot(qg, kc, dim) * scale_f + row_bias[c];
        }
      }
      for (int64_t g = 0; g < groups; ++g) {
        float* w = weights.data() + g * columns;
        const float peak = *std::max_element(w, w + columns);
        const Vec peak_vec(peak);
        Vec total_vec(0.f);
        int64_t c = 0;
        for (; c + kLanes <= columns; c += kLanes) {
          const Vec e = (Vec::loadu(w + c) - peak_vec).exp();
          e.store(w + c);
          total_vec = total_vec + e;
        }
        float total = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, total_vec);
        for (; c < columns; ++c) {
          w[c] = std::exp(w[c] - peak);
          total += w[c];
        }
        // The softmax weights, normalized once for every lane of the output.
        const float inverse_total = 1.f / total;
        for (c = 0; c < columns; ++c) {
          w[c] *= inverse_total;
        }
      }
      float* o = os + r * heads * dim + kvh * groups * dim;
      // Each output lane sums its columns in order in a register (the same sums as adding into `o`).
      for (int64_t g = 0; g < groups; ++g) {
        const float* wg = weights.data() + g * columns;
        float* og = o + g * dim;
        int64_t i = 0;
        for (; i + kLanes <= dim; i += kLanes) {
          Vec sum(0.f);
          for (int64_t c = 0; c < columns; ++c) {
            if (row_bias[c] != minus_inf) {
              sum = at::vec::fmadd(Vec(wg[c]), Vec::loadu(value_columns[c] + i), sum);
            }
          }
          sum.store(og + i);
        }
        for (; i < dim; ++i) {
          float sum = 0.f;
          for (int64_t c = 0; c < columns; ++c) {
            if (row_bias[c] != minus_inf) {
              sum += wg[c] * value_columns[c][i];
            }
          }
          og[i] = sum;
        }
      }
    }
  });
  return out;
}


#ifdef __AVX2__
// Panels of a packed (out, in) weight: panel p holds output columns [p·kPanel, (p+1)·kPanel) as `in` rows
// of kPanel floats, so a thread's panels stream through memory in order, end to end, and each row of a
// panel is one cache line: one AVX-512 vector or two AVX2 vectors.
constexpr int64_t kPanel = 16;

#ifdef __AVX512F__
// A panel row is one vector. 32 vector registers hold up to 28 running sums, the panel row, and x's
// broadcast rides in the multiply-add's memory operand: 16 rows of x in one pass over a panel.
using PanelVector = __m512;
constexpr int kRowBlock = 16;
constexpr int kMaxSums = 28;
inline PanelVector load(const float* p) { return _mm512_loadu_ps(p); }
inline PanelVector broadcast(const float* p) { return _mm512_set1_ps(*p); }
inline PanelVector fmadd(PanelVector a, PanelVector b, PanelVector c) { return _mm512_fmadd_ps(a, b, c); }
inline PanelVector add(PanelVector a, PanelVector b) { return _mm512_add_ps(a, b); }
inline PanelVector zero() { return _mm512_setzero_ps(); }
inline void store(float* p, PanelVector a) { _mm512_storeu_ps(p, a); }
#else
// A panel row is two vectors. 16 vector registers hold 12 running sums (two for each of 6 rows), the panel
// row and a broadcast.
using PanelVector = __m256;
constexpr int kRowBlock = 6;
constexpr int kMaxSums = 12;
inline PanelVector load(const float* p) { return _mm256_loadu_ps(p); }
inline PanelVector broadcast(const float* p) { return _mm256_broadcast_ss(p); }
inline PanelVector fmadd(PanelVector a, PanelVector b, PanelVector c) { return _mm256_fmadd_ps(a, b, c); }
inline PanelVector add(PanelVector a, PanelVector b) { return _mm256_add_ps(a, b); }
inline PanelVector zero() { return _mm256_setzero_ps(); }
inline void store(float* p, PanelVector a) { _mm256_storeu_ps(p, a); }
#endif
constexpr int kPanelVectors = kPanel * sizeof(float) / sizeof(PanelVector);
constexpr int kVectorFloats = kPanel / kPanelVectors;
// A row's product sums its `in` columns as kSegments contiguous segments, each in order, then adds the
// segments' sums in order. A pass over few rows sums its segments at once: with one sum per row it would
// wait on each multiply-add's latency rather than on memory (one row: ~0.8x the rate). A pass over more
// rows sums them one after another, in the same order, so a row's product never depends on the rows
// beside it in a call (the same request, the same logprobs, in whatever batch).
constexpr int kSegments = 4;

at::Tensor pack_linear_weight(const at::Tensor& weight) {
  check_float_cpu(weight, "weight");
  TORCH_CHECK(weight.dim() == 2, "weight must be (out, in)");
  const int64_t out_features = weight.size(0), in_features = weight.size(1);
  const int64_t panels = (out_features + kPanel - 1) / kPanel;
  at::Tensor packed = at::empty({panels, in_features, kPanel}, weight.options());
  // Every float is written below but the last panel's columns past out_features: zeros there.
  const int64_t filled = out_features - (panels - 1) * kPanel;
  packed.select(0, panels - 1).narrow(1, filled, kPanel - filled).zero_();
  float* ps = packed.data_ptr<float>();
  if (weight.stride(0) == 1) {
    // The transpose of an (in, out) tensor (the decoder's layout): a panel row is the next kPanel
    // floats of a row of it, copied as they lie, with no transposed copy of the whole weight first.
    const float* ws = weight.data_ptr<float>();
    const int64_t row_stride = weight.stride(1);
    at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
      for (int64_t p = begin; p < end; ++p) {
        const int64_t width = std::min(kPanel, out_features - p * kPanel);
        for (int64_t k = 0; k < in_features; ++k) {
          const float* from = ws + k * row_stride + p * kPanel;
          std::copy(from, from + width, ps + (p * in_features + k) * kPanel);
        }
      }
    });
    return packed;
  }
  const at::Tensor w = weight.contiguous();
  const float* ws = w.data_ptr<float>();
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      for (int64_t j = 0; j < kPanel && p * kPanel + j < out_features; ++j) {
        const float* column = ws + (p * kPanel + j) * in_features;
        float* panel = ps + p * in_features * kPanel + j;
        for (int64_t k = 0; k < in_features; ++k) {
          panel[k * kPanel] = column[k];
        }
      }
    }
  });
  return packed;
}

// y (Rows, width) = x · panel for x given interleaved, xt (in / kPanel, Rows, kPanel): the Rows values a
// panel row meets lie in one cache line of every row's, the next kPanel columns of each.
template <int Rows>
void panel_product(const float* xt, const float* panel, int64_t in_features, float* y, int64_t y_stride,
                   int64_t width) {
  static_assert(Rows >= 1 && Rows <= kRowBlock);
  constexpr int kSums = Rows * kPanelVectors;
  // Segments summed at once: all where their sums fit the registers.
  constexpr int kLive = kSums * kSegments <= kMaxSums ? kSegments : 1;
  const int64_t segment = (in_features + kSegments - 1) / kSegments;
  PanelVector totals[kSums];
  PanelVector sums[kLive * kSums];
  auto step = [&](int live, int64_t k) __attribute__((always_inline)) {
    const float* weights = panel + k * kPanel;
    // The next panel's same row into L2, a panel ahead of its use: one stream per segment, each ahead
    // across the end of a panel (a prefetch a few rows ahead, into L1, gave one row ~0.7x the rate).
    _mm_prefetch(reinterpret_cast<const char*>(weights + in_features * kPanel), _MM_HINT_T1);
    PanelVector w[kPanelVectors];
#pragma GCC unroll 4
    for (int v = 0; v < kPanelVectors; ++v) {
      w[v] = load(weights + v * kVectorFloats);
    }
#pragma GCC unroll 16
    for (int r = 0; r < Rows; ++r) {
      const PanelVector xr = broadcast(Rows == 1 ? xt + k : xt + (k / kPanel * Rows + r) * kPanel + k % kPanel);
#pragma GCC unroll 4
      for (int v = 0; v < kPanelVectors; ++v) {
        PanelVector& sum = sums[live * kSums + r * kPanelVectors + v];
        sum = fmadd(xr, w[v], sum);
      }
    }
  };
  for (int first = 0; first < kSegments; first += kLive) {
    std::fill(std::begin(sums), std::end(sums), zero());
    auto begin = [&](int live) { return std::min(in_features, (first + live) * segment); };
    auto length = [&](int live) { return std::min(in_features, begin(live) + segment) - begin(live); };
    // The live segments side by side while all have columns left (the last may be shorter), then the rest.
    const int64_t together = length(kLive - 1);
    for (int64_t i = 0; i < together; ++i) {
#pragma GCC unroll 8
      for (int live = 0; live < kLive; ++live) {
        step(live, begin(live) + i);
      }
    }
    for (int live = 0; live < kLive; ++live) {
      for (int64_t i = together; i < length(live); ++i) {
        step(live, begin(live) + i);
      }
    }
#pragma GCC unroll 8
    for (int live = 0; live < kLive; ++live) {
#pragma GCC unroll 32
      for (int i = 0; i < kSums; ++i) {
        totals[i] = first + live == 0 ? sums[i] : add(totals[i], sums[live * kSums + i]);
      }
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < Rows; ++r) {
    float row[kPanel];
#pragma GCC unroll 4
    for (int v = 0; v < kPanelVectors; ++v) {
      store(row + v * kVectorFloats, totals[r * kPanelVectors + v]);
    }
    std::copy(row, row + width, y + r * y_stride);
  }
}

using PanelProduct = void (*)(const float*, const float*, int64_t, float*, int64_t, int64_t);

template <int... Rows>
constexpr auto panel_products(std::integer_sequence<int, Rows...>) {
  return std::array<PanelProduct, sizeof...(Rows)>{panel_product<Rows + 1>...};
}
constexpr auto kPanelProducts = panel_products(std::make_integer_sequence<int, kRowBlock>{});

// x (rows, in) · weightᵀ for a weight packed by pack_linear_weight: (rows, out_features).
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, int64_t out_features) {
  check_float_cpu(x, "x");
  check_float_cpu(packed, "packed");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be (rows, in) with contiguous rows");
  TORCH_CHECK(packed.dim() == 3 && packed.is_contiguous() && packed.size(1) == x.size(1) && packed.size(2) == kPanel &&
                  packed.size(0) == (out_features + kPanel - 1) / kPanel,
              "packed must be pack_linear_weight's layout of an (out_features, in) weight");
  const int64_t rows = x.size(0), in_features = x.size(1), panels = packed.size(0);
  at::Tensor y = at::empty({rows, out_features}, x.options());
  const float* xs = x.data_ptr<float>();
  const float* ps = packed.data_ptr<float>();
  float* ys = y.data_ptr<float>();
  const int64_t x_stride = x.stride(0);
  // Rows of x taken per sweep over the panels: a multiple of the row block that stays in L2 cache
  // (~256 KiB of it) while every panel passes; a decode step's rows are one sweep.
  const int64_t sweep =
      std::max<int64_t>(kRowBlock, (65536 / std::max<int64_t>(1, in_features)) / kRowBlock * kRowBlock);
  const int64_t padded = (in_features + kPanel - 1) / kPanel * kPanel;
  std::vector<float> interleaved(std::min(rows, sweep) * padded);
  for (int64_t first = 0; first < rows; first += sweep) {
    const int64_t last = std::min(rows, first + sweep);
    // The sweep's rows in passes as even as the row block allows (17 rows: 9 and 8, not 16 and 1), each
    // pass's rows interleaved in turn (a copy of kPanel floats at a time).
    const int64_t passes = (last - first + kRowBlock - 1) / kRowBlock;
    auto start = [&](int64_t pass) { return first + pass * (last - first) / passes; };
    for (int64_t pass = 0; pass < passes; ++pass) {
      const int64_t begin = start(pass), block = start(pass + 1) - begin;
      float* xt = interleaved.data() + (begin - first) * padded;
      for (int64_t r = 0; r < block; ++r) {
        for (int64_t k = 0; k < in_features; k += kPanel) {
          const float* from = xs + (begin + r) * x_stride + k;
          std::copy(from, from + std::min(kPanel, in_features - k), xt + (k / kPanel * block + r) * kPanel);
        }
      }
    }
    at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
      for (int64_t p = begin; p < end; ++p) {
        for (int64_t pass = 0; pass < passes; ++pass) {
          const int64_t r = start(pass);
          kPanelProducts[start(pass + 1) - r - 1](interleaved.data() + (r - first) * padded,
                                                  ps + p * in_features * kPanel, in_features,
                                                  ys + r * out_features + p * kPanel, out_features,
                                                  std::min(kPanel, out_features - p * kPanel));
        }
      }
    });
  }
  return y;
}
#endif  // __AVX2__

}  // namespace

TORCH_LIBRARY(tinkerrpc_cpu, m) {
  m.def("residual_rms_norm(Tensor(a!) x, Tensor? delta, Tensor weight, float eps) -> Tensor");
  m.def("silu_and_multiply(Tensor gate_up) -> Tensor");
  m.def("rotary_qk(Tensor qk, Tensor cos, Tensor signed_sin, Tensor? norm_weight, float eps) -> Tensor");
  m.def("pack_linear_weight(Tensor weight) -> Tensor");
  m.def("packed_linear(Tensor x, Tensor packed, int out_features) -> Tensor");
  m.def(
      "decode_attention(Tensor q, Tensor k, Tensor v, Tensor bias, float scale, int shared_begin, int shared_end)"
      " -> Tensor");
}

TORCH_LIBRARY_IMPL(tinkerrpc_cpu, CPU, m) {
  m.impl("residual_rms_norm", residual_rms_norm);
  m.impl("silu_and_multiply", silu_and_multiply);
  m.impl("rotary_qk", rotary_qk);
  m.impl("decode_attention", decode_attention);
#ifdef __AVX2__
  m.impl("pack_linear_weight", pack_linear_weight);
  m.impl("packed_linear", packed_linear);
#endif
}
