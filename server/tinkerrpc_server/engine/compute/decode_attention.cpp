// A decode step's attention as one CPU kernel (see cpu_kernels.cpp): each row's one query over its KV
// cache, grouped-query, reading the columns every row shares once.
#include "cpu_kernels.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>
#include <vector>

namespace {

using namespace tinkerrpc_kernels;

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

// out[Vectors lanes' vectors] = Σ weights[index[a]] · columns[a][offset...], over a in order for every lane:
// the tile's multiply-adds are independent, so their latency overlaps (a chain over one vector of lanes at a
// time waited on each multiply-add: ~4x the time at 16 rows).
constexpr int kTile = 8;
template <int Vectors>
void weighted_sum(const float* weights, const int64_t* index, const float* const* columns, int64_t count,
                  int64_t offset, float* out) {
  Vec sums[Vectors];
  for (auto& sum : sums) {
    sum = Vec(0.f);
  }
  for (int64_t a = 0; a < count; ++a) {
    const Vec weight(weights[index[a]]);
    const float* values = columns[a] + offset;
#pragma GCC unroll 8
    for (int v = 0; v < Vectors; ++v) {
      sums[v] = at::vec::fmadd(weight, Vec::loadu(values + v * kLanes), sums[v]);
    }
  }
#pragma GCC unroll 8
  for (int v = 0; v < Vectors; ++v) {
    sums[v].store(out + v * kLanes);
  }
}

}  // namespace

namespace tinkerrpc_kernels {

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
    std::vector<int64_t> active_columns(columns);
    // Column c of row r's kv head's keys or values.
    auto head_column = [&](int64_t r, int64_t kvh, const float* base, const int64_t* strides, int64_t c) {
      const int64_t source = (c >= shared_begin && c < shared_end) ? 0 : r;
      return base + source * strides[0] + kvh * strides[1] + c * strides[2];
    };
    for (int64_t unit = begin; unit < end; ++unit) {
      const int64_t r = unit / kv_heads, kvh = unit % kv_heads;
      const float* row_bias = bs + r * columns;
      auto column = [&](const float* base, const int64_t* strides, int64_t c) {
        return head_column(r, kvh, base, strides, c);
      };
      // The next unit's keys and values on their way into L2 while this one computes: a unit reads two
      // runs of a few KiB, too short for the hardware prefetcher, and a decode step's cache is not in
      // cache (30 layers of it, 16 rows: ~2.5x the time of the same call on cached data).
      if (unit + 1 < end) {
        const int64_t next_r = (unit + 1) / kv_heads, next_kvh = (unit + 1) % kv_heads;
        const float* next_bias = bs + next_r * columns;
        for (int64_t c = 0; c < columns; ++c) {
          if (next_bias[c] == minus_inf) {
            continue;
          }
          for (const auto& [base, strides] : {std::pair{ks, k_strides}, {vs, v_strides}}) {
            const char* line = reinterpret_cast<const char*>(head_column(next_r, next_kvh, base, strides, c));
            for (int64_t byte = 0; byte < dim * static_cast<int64_t>(sizeof(float)); byte += 64) {
              _mm_prefetch(line + byte, _MM_HINT_T1);
            }
          }
        }
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
        // The peak in vector lanes (one scalar maximum after another waited on each in turn).
        Vec peaks(minus_inf);
        int64_t c = 0;
        for (; c + kLanes <= columns; c += kLanes) {
          peaks = at::vec::maximum(peaks, Vec::loadu(w + c));
        }
        float peak = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return at::vec::maximum(x, y); }, peaks);
        for (; c < columns; ++c) {
          peak = std::max(peak, w[c]);
        }
        const Vec peak_vec(peak);
        Vec total_vec(0.f);
        c = 0;
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
      // The columns that are not padding, in order: only they are read (padding may hold anything).
      int64_t active = 0;
      for (int64_t c = 0; c < columns; ++c) {
        if (row_bias[c] != minus_inf) {
          value_columns[active] = column(vs, v_strides, c);
          active_columns[active++] = c;
        }
      }
      float* o = os + r * heads * dim + kvh * groups * dim;
      const int64_t vector_lanes = dim / kLanes * kLanes;
      for (int64_t g = 0; g < groups; ++g) {
        const float* wg = weights.data() + g * columns;
        float* og = o + g * dim;
        int64_t i = 0;
        for (; i + kTile * kLanes <= vector_lanes; i += kTile * kLanes) {
          weighted_sum<kTile>(wg, active_columns.data(), value_columns.data(), active, i, og + i);
        }
        for (; i < vector_lanes; i += kLanes) {
          weighted_sum<1>(wg, active_columns.data(), value_columns.data(), active, i, og + i);
        }
        for (; i < dim; ++i) {
          float sum = 0.f;
          for (int64_t a = 0; a < active; ++a) {
            sum += wg[active_columns[a]] * value_columns[a][i];
          }
          og[i] = sum;
        }
      }
    }
  });
  return out;
}

}  // namespace tinkerrpc_kernels

TORCH_LIBRARY_IMPL(tinkerrpc_cpu, CPU, m) { m.impl("decode_attention", tinkerrpc_kernels::decode_attention); }
