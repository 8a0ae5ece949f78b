// The sampler's float32 matmul by a weight packed into column panels, on AVX2 and AVX-512 CPUs (see
// cpu_kernels.cpp; `python -m bench.matmul_kernels` times it against MKL's and oneDNN's), and a decoder
// layer's two calls around its attention composed from it and cpu_kernels.cpp's kernels.
#include "cpu_kernels.h"

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <array>
#include <memory>
#include <utility>
#include <vector>

#ifdef __AVX2__
namespace {

using namespace tinkerrpc_kernels;

// Panels of a packed (out, in) weight: panel p holds output columns [p·kPanel, (p+1)·kPanel) as `in` rows
// of kPanel floats, each row one cache line: one AVX-512 vector or two AVX2 vectors. The rows lie segment
// by segment (kSegments below): (segments, panels, segment rows, kPanel), so a pass over a thread's panels
// reads one stream per segment, each end to end through memory. (Panel after panel, each holding all its
// rows, one row's pass restarted its four streams every panel: one SmolLM2 step's matmuls read 0.80x
// torch.sum's bandwidth on two threads, 0.89x this way.)
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
// Passes over at most this many rows of x do not prefetch the weight in software (see panel_product).
constexpr int kRowsWithoutPrefetch = 2;
// Rows of each segment in the packed layout (the last segment's may be fewer).
inline int64_t segment_rows(int64_t in_features) { return (in_features + kSegments - 1) / kSegments; }

// The shape of pack_linear_weight's layout of an (out_features, in_features) weight.
std::vector<int64_t> packed_weight_shape(int64_t out_features, int64_t in_features) {
  TORCH_CHECK(out_features > 0 && in_features > 0, "a weight's out and in features must be positive");
  return {kSegments, (out_features + kPanel - 1) / kPanel, segment_rows(in_features), kPanel};
}

// weight (out, in) laid out as panels into `packed` (packed_weight_shape, contiguous): wherever the caller
// keeps it, e.g. beside the other weights a decode step reads after it.
void pack_linear_weight_into(const at::Tensor& weight, const at::Tensor& packed) {
  check_float_cpu(weight, "weight");
  check_float_cpu(packed, "packed");
  TORCH_CHECK(weight.dim() == 2, "weight must be (out, in)");
  const int64_t out_features = weight.size(0), in_features = weight.size(1);
  TORCH_CHECK(packed.is_contiguous() && packed.sizes() == at::IntArrayRef(packed_weight_shape(out_features, in_features)),
              "packed must be contiguous, of packed_weight_shape");
  const int64_t panels = packed.size(1), segment = packed.size(2);
  // Zeros where no weight lands: the last panel's columns past out_features, the last segment's rows past
  // in_features.
  packed.zero_();
  float* ps = packed.data_ptr<float>();
  // Where panel p's row k lies.
  auto row = [&](int64_t p, int64_t k) { return ps + ((k / segment * panels + p) * segment + k % segment) * kPanel; };
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
          std::copy(from, from + width, row(p, k));
        }
      }
    });
    return;
  }
  const at::Tensor w = weight.contiguous();
  const float* ws = w.data_ptr<float>();
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      for (int64_t j = 0; j < kPanel && p * kPanel + j < out_features; ++j) {
        const float* column = ws + (p * kPanel + j) * in_features;
        for (int64_t k = 0; k < in_features; ++k) {
          row(p, k)[j] = column[k];
        }
      }
    }
  });
}

at::Tensor pack_linear_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2, "weight must be (out, in)");
  at::Tensor packed = at::empty(packed_weight_shape(weight.size(0), weight.size(1)), weight.options());
  pack_linear_weight_into(weight, packed);
  return packed;
}

// y (Rows, width) = x · panel for x given interleaved, xt (in / kPanel, Rows, kPanel): the Rows values a
// panel row meets lie in one cache line of every row's, the next kPanel columns of each. `panel`: its first
// segment's rows; the next segment's lie segment_stride floats on.
template <int Rows>
void panel_product(const float* xt, const float* panel, int64_t segment_stride, int64_t in_features, float* y,
                   int64_t y_stride, int64_t width) {
  static_assert(Rows >= 1 && Rows <= kRowBlock);
  constexpr int kSums = Rows * kPanelVectors;
  // Segments summed at once: all where their sums fit the registers.
  constexpr int kLive = kSums * kSegments <= kMaxSums ? kSegments : 1;
  const int64_t segment = segment_rows(in_features);
  PanelVector totals[kSums];
  PanelVector sums[kLive * kSums];
  int first = 0;  // the pass's first segment
  auto step = [&](int live, int64_t i) __attribute__((always_inline)) {
    const int64_t k = (first + live) * segment + i;
    const float* weights = panel + (first + live) * segment_stride + i * kPanel;
    // The next panel's same row into L2, a panel ahead of its use, in this segment's stream (a prefetch a
    // few rows ahead, into L1, gave one row ~0.7x the rate). Few rows leave the hardware's prefetcher to
    // it: theirs took 1.15-1.3x the time of a torch.sum of the weight when the host read at ~60 GB/s
    // (~1.0x without it); from 3 rows on it pays (16 rows: 0.5x the time of a pass without it).
    if constexpr (Rows > kRowsWithoutPrefetch) {
      _mm_prefetch(reinterpret_cast<const char*>(weights + segment * kPanel), _MM_HINT_T1);
    }
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
  for (first = 0; first < kSegments; first += kLive) {
    std::fill(std::begin(sums), std::end(sums), zero());
    auto begin = [&](int live) { return std::min(in_features, (first + live) * segment); };
    auto length = [&](int live) { return std::min(in_features, begin(live) + segment) - begin(live); };
    // The live segments side by side while all have columns left (the last may be shorter), then the rest.
    const int64_t together = length(kLive - 1);
    for (int64_t i = 0; i < together; ++i) {
#pragma GCC unroll 8
      for (int live = 0; live < kLive; ++live) {
        step(live, i);
      }
    }
    for (int live = 0; live < kLive; ++live) {
      for (int64_t i = together; i < length(live); ++i) {
        step(live, i);
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
    if (width == kPanel) {
#pragma GCC unroll 4
      for (int v = 0; v < kPanelVectors; ++v) {
        store(y + r * y_stride + v * kVectorFloats, totals[r * kPanelVectors + v]);
      }
      continue;
    }
    // The last panel's columns past out_features are not y's.
    float row[kPanel];
#pragma GCC unroll 4
    for (int v = 0; v < kPanelVectors; ++v) {
      store(row + v * kVectorFloats, totals[r * kPanelVectors + v]);
    }
    std::copy(row, row + width, y + r * y_stride);
  }
}

using PanelProduct = void (*)(const float*, const float*, int64_t, int64_t, float*, int64_t, int64_t);

template <int... Rows>
constexpr auto panel_products(std::integer_sequence<int, Rows...>) {
  return std::array<PanelProduct, sizeof...(Rows)>{panel_product<Rows + 1>...};
}
constexpr auto kPanelProducts = panel_products(std::make_integer_sequence<int, kRowBlock>{});

// x · weightᵀ for a weight packed by pack_linear_weight, x (rows, in_features) made row by row as the
// product needs it: row(r, scratch) returns row r's in_features floats, in scratch (in_features floats of the
// calling thread's) or where they already lie. Each thread makes its share of the rows, then after a barrier
// takes its share of the panels, in one parallel region: the row work a layer does before a matmul (the
// residual add and norm, the gated activation) runs on every thread instead of on one while the rest wait.
// `row` must not throw.
template <typename Row>
at::Tensor made_rows_linear(int64_t rows, int64_t in_features, const at::Tensor& packed, int64_t out_features,
                            const at::TensorOptions& options, const Row& row) {
  check_float_cpu(packed, "packed");
  const int64_t segment = segment_rows(in_features);
  TORCH_CHECK(packed.dim() == 4 && packed.is_contiguous() && packed.size(0) == kSegments && packed.size(2) == segment &&
                  packed.size(3) == kPanel && packed.size(1) == (out_features + kPanel - 1) / kPanel,
              "packed must be pack_linear_weight's layout of an (out_features, in) weight");
  const int64_t panels = packed.size(1);
  at::Tensor y = at::empty({rows, out_features}, options);
  const float* ps = packed.data_ptr<float>();
  float* ys = y.data_ptr<float>();
  // Rows of x taken per sweep over the panels: a multiple of the row block that stays in L2 cache
  // (~256 KiB of it) while every panel passes; a decode step's rows are one sweep.
  const int64_t sweep =
      std::max<int64_t>(kRowBlock, (65536 / std::max<int64_t>(1, in_features)) / kRowBlock * kRowBlock);
  const int64_t padded = (in_features + kPanel - 1) / kPanel * kPanel;
  const int threads =
      at::in_parallel_region() ? 1 : static_cast<int>(std::clamp<int64_t>(panels, 1, at::get_num_threads()));
  // Left uninitialized: a pass reads only the in_features columns of each row, and `row` writes a thread's
  // scratch before it returns it.
  const std::unique_ptr<float[]> interleaved(new float[std::min(rows, sweep) * padded]);
  const std::unique_ptr<float[]> scratches(new float[threads * in_features]);
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    const int64_t thread = omp_get_thread_num(), team = omp_get_num_threads();
    float* scratch = scratches.get() + thread * in_features;
    for (int64_t first = 0; first < rows; first += sweep) {
      const int64_t last = std::min(rows, first + sweep);
      // The sweep's rows in passes as even as the row block allows (17 rows: 9 and 8, not 16 and 1), each
      // pass's rows interleaved in turn (a copy of kPanel floats at a time).
      const int64_t passes = (last - first + kRowBlock - 1) / kRowBlock;
      auto start = [&](int64_t pass) { return first + pass * (last - first) / passes; };
      for (int64_t pass = 0; pass < passes; ++pass) {
        const int64_t begin = start(pass), block = start(pass + 1) - begin;
        float* xt = interleaved.get() + (begin - first) * padded;
        for (int64_t r = block * thread / team; r < block * (thread + 1) / team; ++r) {
          const float* from = row(begin + r, scratch);
          int64_t k = 0;
          // A whole chunk as vectors: std::copy's call to memmove, 64 bytes at a time, was ~3% of a step.
          for (; k + kPanel <= in_features; k += kPanel) {
#pragma GCC unroll 4
            for (int v = 0; v < kPanelVectors; ++v) {
              store(xt + (k / kPanel * block + r) * kPanel + v * kVectorFloats, load(from + k + v * kVectorFloats));
            }
          }
          std::copy(from + k, from + in_features, xt + (k / kPanel * block + r) * kPanel);
        }
      }
#pragma omp barrier
      for (int64_t p = panels * thread / team; p < panels * (thread + 1) / team; ++p) {
        for (int64_t pass = 0; pass < passes; ++pass) {
          const int64_t r = start(pass);
          kPanelProducts[start(pass + 1) - r - 1](interleaved.get() + (r - first) * padded, ps + p * segment * kPanel,
                                                  panels * segment * kPanel, in_features,
                                                  ys + r * out_features + p * kPanel, out_features,
                                                  std::min(kPanel, out_features - p * kPanel));
        }
      }
      // The next sweep's rows go where this one's lay.
      if (last < rows) {
#pragma omp barrier
      }
    }
  }
  return y;
}

// x (rows, in) · weightᵀ for a weight packed by pack_linear_weight: (rows, out_features).
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, int64_t out_features) {
  check_float_cpu(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be (rows, in) with contiguous rows");
  const float* xs = x.data_ptr<float>();
  const int64_t x_stride = x.stride(0);
  return made_rows_linear(x.size(0), x.size(1), packed, out_features, x.options(),
                          [&](int64_t r, float*) { return xs + r * x_stride; });
}

}  // namespace

namespace tinkerrpc_kernels {

// A decoder layer's projection to q, k and v on a panel-packed weight, in one call: x += delta (the last
// layer's output, when given) in place, then its RMSNorm times qkvᵀ.
at::Tensor decoder_qkv(at::Tensor x, const std::optional<at::Tensor>& delta, const at::Tensor& norm_weight,
                       double eps, const at::Tensor& qkv, int64_t qkv_features) {
  return made_rows_linear(x.size(0), x.size(1), qkv, qkv_features, x.options(),
                          AddedAndNormedRows(x, delta, norm_weight, eps));
}

// A decoder layer's second half on panel-packed weights, in one call: x += attended · oᵀ in place, then
// silu(gate) · up of x's RMSNorm, projected by down (returned: the next layer adds it). The same arithmetic
// as the five calls it replaces, without their trips through Python and the dispatcher, and with the norm
// and the gated activation made inside the next matmul's parallel region.
at::Tensor decoder_mlp(at::Tensor x, const at::Tensor& attended, const at::Tensor& o, int64_t o_features,
                       const at::Tensor& norm_weight, double eps, const at::Tensor& gate_up,
                       int64_t gate_up_features, const at::Tensor& down, int64_t down_features) {
  TORCH_CHECK(gate_up_features % 2 == 0, "gate/up must have an even number of out features");
  const int64_t width = gate_up_features / 2;
  const std::optional<at::Tensor> projected = packed_linear(attended, o, o_features);
  const at::Tensor gated = made_rows_linear(x.size(0), x.size(1), gate_up, gate_up_features, x.options(),
                                            AddedAndNormedRows(x, projected, norm_weight, eps));
  const float* gs = gated.data_ptr<float>();
  return made_rows_linear(x.size(0), width, down, down_features, x.options(), [&](int64_t r, float* scratch) {
    silu_and_multiply_row(gs + r * gate_up_features, gs + r * gate_up_features + width, scratch, width);
    return static_cast<const float*>(scratch);
  });
}

}  // namespace tinkerrpc_kernels

// No tensor to dispatch on: one kernel for every caller.
TORCH_LIBRARY_FRAGMENT(tinkerrpc_cpu, m) {
  m.def("packed_weight_shape(int out_features, int in_features) -> int[]", packed_weight_shape);
}

TORCH_LIBRARY_IMPL(tinkerrpc_cpu, CPU, m) {
  m.impl("pack_linear_weight_into", pack_linear_weight_into);
  m.impl("pack_linear_weight", pack_linear_weight);
  m.impl("packed_linear", packed_linear);
  m.impl("decoder_qkv", tinkerrpc_kernels::decoder_qkv);
  m.impl("decoder_mlp", tinkerrpc_kernels::decoder_mlp);
}
#endif  // __AVX2__
