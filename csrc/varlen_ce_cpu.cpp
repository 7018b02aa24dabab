// CPU row kernel of hpsft's varlen cross-entropy (contract: hpsft/ops/row_options.py).
//
// The GEMMs around it run in ATen (hpsft/ops/fused_linear_ce.py); this kernel fuses what
// would otherwise be several full passes over a (rows, V) logit block: soft-capping, an
// online log-sum-exp over vocabulary chunks, the loss terms and d(logits) written in place.
// Rows run in parallel (at::parallel_for, OpenMP); loops over the vocabulary vectorise.

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

namespace {

// std::bit_cast is C++20, and older torch versions (pyproject allows >= 2.6) build extensions
// as C++17: the sources stay C++17 (tests/ops/test_cpp_sources_compile.py checks it).
// A 4-byte memcpy compiles to a register move and still vectorises.
inline float float_from_bits(int32_t bits) {
  float value;
  std::memcpy(&value, &bits, sizeof value);
  return value;
}

// 2048 floats (8 KiB) of a row stay in L1 between the max and the sum-of-exp sweeps.
constexpr int64_t kVocabChunk = 2048;

// exp the compiler can vectorise (std::exp is an opaque libm call): Cephes-style range
// reduction and a degree-6 polynomial, relative error < 1e-7. Inputs below -87 give ~1e-38,
// not 0. Built only from arithmetic and selects: floor/nearbyint would stay scalar calls.
inline float exp_of(float x) {
  x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
  // round(x / ln2) with the 1.5 * 2^23 trick: the sum rounds to an integer.
  const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;  // x - n ln2, ln2 split in two
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  return p * float_from_bits((static_cast<int32_t>(n) + 127) << 23);  // p * 2^n
}
inline double exp_of(double x) { return std::exp(x); }

// tanh through exp_of so the soft-capping loop vectorises too (absolute error ~1e-7).
inline float tanh_of(float x) { return 1.0f - 2.0f / (exp_of(2.0f * x) + 1.0f); }
inline double tanh_of(double x) { return std::tanh(x); }

struct Options {
  double softcap;  // 0: off
  double label_smoothing;
  double z_loss_weight;
};

template <typename scalar_t>
struct RowResult {
  scalar_t loss, zloss, logprob;
};

// What one sweep over a row's (soft-capped) logits gathers: max and sum of exp(z - max) by an
// online log-sum-exp over vocabulary chunks, and the sum and count of the finite logits.
template <typename scalar_t>
struct RowStatistics {
  scalar_t max, sum_exp;
  double logit_sum;  // of the finite logits; fp64 across chunks: the mean is compared with lse
  int64_t finite_count;
};

template <typename scalar_t>
void softcap_row(scalar_t* z, int64_t vocab, scalar_t cap) {
#pragma omp simd
  for (int64_t j = 0; j < vocab; ++j) z[j] = cap * tanh_of(z[j] / cap);
}

template <typename scalar_t>
RowStatistics<scalar_t> row_statistics(const scalar_t* z, int64_t vocab) {
  // Online log-sum-exp: each chunk is reduced against its own max, then merged.
  constexpr scalar_t kMinusInf = -std::numeric_limits<scalar_t>::infinity();
  scalar_t running_max = kMinusInf;
  scalar_t running_sum = 0;
  // Label smoothing spreads eps over the entries with a finite logit: a -inf logit (a masked
  // vocabulary entry, not soft-capped) is not in the vocabulary the row chooses from.
  double logit_sum = 0;
  int64_t finite_count = 0;
  for (int64_t begin = 0; begin < vocab; begin += kVocabChunk) {
    const int64_t end = std::min(begin + kVocabChunk, vocab);
    scalar_t chunk_max = z[begin];
#pragma omp simd reduction(max : chunk_max)
    for (int64_t j = begin; j < end; ++j) chunk_max = chunk_max > z[j] ? chunk_max : z[j];
    // A fully masked chunk (every logit -inf) adds nothing, and z - chunk_max would be
    // -inf - -inf = NaN.
    if (chunk_max == kMinusInf) continue;
    // Within a chunk, sums of z - chunk_max stay small whatever the common logit offset.
    scalar_t chunk_sum = 0, chunk_shifted_sum = 0;
    int64_t chunk_count = 0;
#pragma omp simd reduction(+ : chunk_sum, chunk_shifted_sum, chunk_count)
    for (int64_t j = begin; j < end; ++j) {
      const bool finite = z[j] > kMinusInf;
      chunk_sum += exp_of(z[j] - chunk_max);
      chunk_shifted_sum += finite ? z[j] - chunk_max : scalar_t(0);
      chunk_count += finite ? 1 : 0;
    }
    logit_sum += chunk_shifted_sum + static_cast<double>(chunk_max) * static_cast<double>(chunk_count);
    finite_count += chunk_count;
    if (chunk_max > running_max) {
      running_sum = running_sum * std::exp(running_max - chunk_max) + chunk_sum;
      running_max = chunk_max;
    } else {
      running_sum += chunk_sum * std::exp(chunk_max - running_max);
    }
  }
  return {running_max, running_sum, logit_sum, finite_count};
}

// d(logits) over the row, but for the target's term: (p_j * p_factor - uniform on finite
// logits) * dz'/dz, with p_j = exp(z'_j - lse).
template <typename scalar_t>
void write_row_gradient(scalar_t* z, int64_t vocab, scalar_t lse, scalar_t p_factor, scalar_t uniform, scalar_t cap) {
  constexpr scalar_t kMinusInf = -std::numeric_limits<scalar_t>::infinity();
  if (cap > 0) {
#pragma omp simd
    for (int64_t j = 0; j < vocab; ++j) {
      const scalar_t slope = 1 - (z[j] / cap) * (z[j] / cap);
      z[j] = (exp_of(z[j] - lse) * p_factor - uniform) * slope;  // z' = +-cap: always finite
    }
  } else {
#pragma omp simd
    for (int64_t j = 0; j < vocab; ++j) z[j] = exp_of(z[j] - lse) * p_factor - (z[j] > kMinusInf ? uniform : scalar_t(0));
  }
}

template <typename scalar_t>
RowResult<scalar_t> cross_entropy_row(scalar_t* z, int64_t vocab, int64_t label, scalar_t scale,
                                      const Options& opt, bool compute_grad) {
  const scalar_t cap = static_cast<scalar_t>(opt.softcap);
  const scalar_t eps = static_cast<scalar_t>(opt.label_smoothing);
  const scalar_t lam = static_cast<scalar_t>(opt.z_loss_weight);
  if (cap > 0) softcap_row(z, vocab, cap);
  const RowStatistics<scalar_t> stats = row_statistics(z, vocab);
  const scalar_t lse = stats.max + std::log(stats.sum_exp);
  const scalar_t target = z[label];
  const scalar_t zloss = lam * lse * lse;
  const scalar_t mean_logit = static_cast<scalar_t>(stats.logit_sum / static_cast<double>(stats.finite_count));
  // Written as differences against lse: with a large common logit offset, lse - target and
  // lse - mean_logit are small numbers and must not be formed from large ones.
  const scalar_t smoothing_term = eps > 0 ? eps * (lse - mean_logit) : scalar_t(0);
  const scalar_t loss = (1 - eps) * (lse - target) + smoothing_term + zloss;
  const RowResult<scalar_t> result{loss, zloss, target - lse};
  if (!compute_grad) return result;

  const scalar_t p_factor = (1 + 2 * lam * lse) * scale;
  const scalar_t uniform = eps / static_cast<scalar_t>(stats.finite_count) * scale;  // on finite logits only
  const scalar_t target_slope = cap > 0 ? 1 - (target / cap) * (target / cap) : scalar_t(1);
  write_row_gradient(z, vocab, lse, p_factor, uniform, cap);
  z[label] -= (1 - eps) * target_slope * scale;
  return result;
}

void check_block(const at::Tensor& logits, const at::Tensor& labels, bool labels_may_be_elsewhere) {
  TORCH_CHECK_VALUE(logits.device().is_cpu(), "logits must be a CPU tensor");
  TORCH_CHECK_VALUE(logits.dim() == 2 && (logits.size(1) > 0 || labels_may_be_elsewhere),
                    "logits must be (rows, V) with V > 0");
  TORCH_CHECK_VALUE(logits.stride(1) == 1 || logits.size(1) == 0, "logits rows must be contiguous (stride(1) == 1)");
  TORCH_CHECK_VALUE(labels.dtype() == at::kLong && labels.dim() == 1 && labels.size(0) == logits.size(0),
                    "labels must be int64 of shape (rows,)");
  if (logits.size(0) > 0) {
    const int64_t lowest = labels.min().item<int64_t>(), highest = labels.max().item<int64_t>();
    const int64_t floor = labels_may_be_elsewhere ? -1 : 0;
    TORCH_CHECK_VALUE(lowest >= floor && highest < logits.size(1), "labels must lie in [", floor, ", ", logits.size(1),
                      "), got [", lowest, ", ", highest, "]");
  }
}

void check_row_vector(const at::Tensor& vector, const at::Tensor& logits, const char* name) {
  TORCH_CHECK_VALUE(vector.dtype() == logits.dtype() && vector.dim() == 1 && vector.size(0) == logits.size(0), name,
                    " must have the dtype of logits and shape (rows,)");
}

std::vector<at::Tensor> rows_forward_(at::Tensor logits, const at::Tensor& labels, const at::Tensor& row_scale,
                                      double softcap, double label_smoothing, double z_loss_weight, bool compute_grad) {
  check_block(logits, labels, false);
  check_row_vector(row_scale, logits, "row_scale");
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  const auto labels_c = labels.contiguous();
  const auto scale_c = row_scale.contiguous();
  auto loss = at::empty({rows}, logits.options());
  auto zloss = at::empty({rows}, logits.options());
  auto logprob = at::empty({rows}, logits.options());
  const Options opt{softcap, label_smoothing, z_loss_weight};
  AT_DISPATCH_FLOATING_TYPES(logits.scalar_type(), "varlen_ce_rows_cpu", [&] {
    scalar_t* data = logits.data_ptr<scalar_t>();
    const int64_t stride = logits.stride(0);
    const int64_t* label_data = labels_c.data_ptr<int64_t>();
    const scalar_t* scale_data = scale_c.data_ptr<scalar_t>();
    scalar_t* loss_data = loss.data_ptr<scalar_t>();
    scalar_t* zloss_data = zloss.data_ptr<scalar_t>();
    scalar_t* logprob_data = logprob.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 1, [&](int64_t first, int64_t last) {
      for (int64_t r = first; r < last; ++r) {
        const auto result =
            cross_entropy_row(data + r * stride, vocab, label_data[r], scale_data[r], opt, compute_grad);
        loss_data[r] = result.loss;
        zloss_data[r] = result.zloss;
        logprob_data[r] = result.logprob;
      }
    });
  });
  return {loss, zloss, logprob};
}

// The vocabulary-parallel form's two passes over a rank's block (contract: row_options.py).
// Labels are the rank's own column of the target, -1 where it lies in another rank's shard.
std::vector<at::Tensor> shard_stats_(at::Tensor logits, const at::Tensor& labels, double softcap) {
  check_block(logits, labels, true);
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  const auto labels_c = labels.contiguous();
  std::vector<at::Tensor> out;
  for (int i = 0; i < 5; ++i) out.push_back(at::empty({rows}, logits.options()));
  AT_DISPATCH_FLOATING_TYPES(logits.scalar_type(), "varlen_ce_shard_stats_cpu", [&] {
    const scalar_t cap = static_cast<scalar_t>(softcap);
    scalar_t* data = logits.data_ptr<scalar_t>();
    const int64_t stride = logits.stride(0);
    const int64_t* label_data = labels_c.data_ptr<int64_t>();
    scalar_t* max_data = out[0].data_ptr<scalar_t>();
    scalar_t* sum_data = out[1].data_ptr<scalar_t>();
    scalar_t* target_data = out[2].data_ptr<scalar_t>();
    scalar_t* shifted_data = out[3].data_ptr<scalar_t>();
    scalar_t* count_data = out[4].data_ptr<scalar_t>();
    at::parallel_for(0, rows, 1, [&](int64_t first, int64_t last) {
      for (int64_t r = first; r < last; ++r) {
        scalar_t* z = data + r * stride;
        if (cap > 0) softcap_row(z, vocab, cap);
        const RowStatistics<scalar_t> stats = row_statistics(z, vocab);
        max_data[r] = stats.max;
        sum_data[r] = stats.sum_exp;
        target_data[r] = label_data[r] >= 0 ? z[label_data[r]] : scalar_t(0);
        // The finite logits' sum relative to the row's max: small numbers whatever the offset.
        shifted_data[r] = stats.finite_count
            ? static_cast<scalar_t>(stats.logit_sum - static_cast<double>(stats.max) * static_cast<double>(stats.finite_count))
            : scalar_t(0);
        count_data[r] = static_cast<scalar_t>(stats.finite_count);
      }
    });
  });
  return out;
}

void shard_grad_(at::Tensor logits, const at::Tensor& labels, const at::Tensor& lse, const at::Tensor& p_factor,
                 const at::Tensor& uniform, const at::Tensor& target_coef, double softcap) {
  check_block(logits, labels, true);
  for (const auto* vector : {&lse, &p_factor, &uniform, &target_coef}) check_row_vector(*vector, logits, "row statistics");
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  const auto labels_c = labels.contiguous();
  const auto lse_c = lse.contiguous(), p_c = p_factor.contiguous(), u_c = uniform.contiguous(), t_c = target_coef.contiguous();
  AT_DISPATCH_FLOATING_TYPES(logits.scalar_type(), "varlen_ce_shard_grad_cpu", [&] {
    const scalar_t cap = static_cast<scalar_t>(softcap);
    scalar_t* data = logits.data_ptr<scalar_t>();
    const int64_t stride = logits.stride(0);
    const int64_t* label_data = labels_c.data_ptr<int64_t>();
    const scalar_t *lse_data = lse_c.data_ptr<scalar_t>(), *p_data = p_c.data_ptr<scalar_t>();
    const scalar_t *u_data = u_c.data_ptr<scalar_t>(), *t_data = t_c.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 1, [&](int64_t first, int64_t last) {
      for (int64_t r = first; r < last; ++r) {
        scalar_t* z = data + r * stride;
        const int64_t label = label_data[r];
        const scalar_t target = label >= 0 ? z[label] : scalar_t(0);
        const scalar_t target_slope = cap > 0 ? 1 - (target / cap) * (target / cap) : scalar_t(1);
        write_row_gradient(z, vocab, lse_data[r], p_data[r], u_data[r], cap);
        if (label >= 0) z[label] -= t_data[r] * target_slope;
      }
    });
  });
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rows_forward_", &rows_forward_,
        "In place on a (rows, V) logit block: per-row (loss, zloss, logprob); d(logits) * row_scale "
        "written into the block when compute_grad (contract: hpsft/ops/row_options.py)");
  m.def("shard_stats_", &shard_stats_,
        "Vocabulary-parallel pass 1 on a rank's (rows, V/TP) block, soft-capped in place: per-row (max, "
        "sum exp(z - max), target logit or 0, sum of finite z - max, finite count)");
  m.def("shard_grad_", &shard_grad_,
        "Vocabulary-parallel pass 2: d(logits) from the global statistics written over the block");
}
