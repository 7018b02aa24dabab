// CUDA row kernel of hpsft's varlen cross-entropy (contract: hpsft/ops/row_options.py).
//
// Plain CUDA with a C entry point, no torch headers: it compiles with nvcc alone (the tests
// do exactly that on machines without a GPU); csrc/varlen_ce_cuda.cpp binds it to tensors.
// One thread block per row: each thread keeps an online log-sum-exp over a strided slice of
// the vocabulary, the block merges them, then a second sweep writes d(logits) in place.

#include <cuda_runtime.h>

#include <cstdint>

namespace {

constexpr int kThreads = 256;

struct MaxSum {
  float max;
  float sum;  // sum of exp(z - max)
};

__device__ __forceinline__ MaxSum merge(MaxSum a, MaxSum b) {
  const float m = fmaxf(a.max, b.max);
  if (m == -INFINITY) return {m, 0.0f};
  return {m, a.sum * expf(a.max - m) + b.sum * expf(b.max - m)};
}

// Block-wide reduction of (max, sum) and of a plain sum; every thread gets the result.
__device__ void block_reduce(MaxSum& ms, float& total) {
  __shared__ MaxSum shared_ms[kThreads / 32];
  __shared__ float shared_total[kThreads / 32];
  for (int offset = 16; offset > 0; offset /= 2) {
    const MaxSum other{__shfl_down_sync(0xffffffffu, ms.max, offset), __shfl_down_sync(0xffffffffu, ms.sum, offset)};
    ms = merge(ms, other);
    total += __shfl_down_sync(0xffffffffu, total, offset);
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) {
    shared_ms[warp] = ms;
    shared_total[warp] = total;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kThreads / 32; ++w) {
      shared_ms[0] = merge(shared_ms[0], shared_ms[w]);
      shared_total[0] += shared_total[w];
    }
  }
  __syncthreads();
  ms = shared_ms[0];
  total = shared_total[0];
}

__global__ void __launch_bounds__(kThreads)
cross_entropy_rows_kernel(float* logits, int64_t row_stride, const int64_t* labels, const float* row_scale,
                          float* loss_out, float* zloss_out, float* logprob_out, int64_t vocab, float softcap,
                          float label_smoothing, float z_loss_weight, bool compute_grad) {
  const int64_t row = blockIdx.x;
  float* z = logits + row * row_stride;
  const int64_t label = labels[row];
  const bool capped = softcap > 0.0f;

  MaxSum ms{-INFINITY, 0.0f};
  float logit_sum = 0.0f;
  for (int64_t j = threadIdx.x; j < vocab; j += kThreads) {
    float v = z[j];
    if (capped) {
      v = softcap * tanhf(v / softcap);
      z[j] = v;  // the gradient sweep needs z'
    }
    // Online update, one exp per element: rescale the running sum when the max grows. A -inf
    // logit (masked vocabulary entry) adds nothing, and must not reach -inf - -inf = NaN.
    if (v > ms.max) {
      ms.sum = ms.sum * expf(ms.max - v) + 1.0f;
      ms.max = v;
    } else if (v > -INFINITY) {
      ms.sum += expf(v - ms.max);
    }
    logit_sum += v;
  }
  block_reduce(ms, logit_sum);
  const float lse = ms.max + logf(ms.sum);
  const float target = z[label];  // visible: block_reduce synchronised after the capping writes
  const float zloss = z_loss_weight * lse * lse;
  if (threadIdx.x == 0) {
    // Differences against lse: a large common logit offset cancels before it can round. The
    // smoothing term only when it is on: with a -inf logit it is infinite, and 0 * inf is NaN.
    const float smoothing =
        label_smoothing > 0.0f ? label_smoothing * (lse - logit_sum / static_cast<float>(vocab)) : 0.0f;
    loss_out[row] = (1.0f - label_smoothing) * (lse - target) + smoothing + zloss;
    zloss_out[row] = zloss;
    logprob_out[row] = target - lse;
  }
  if (!compute_grad) return;
  const float scale = row_scale[row];
  const float p_factor = (1.0f + 2.0f * z_loss_weight * lse) * scale;
  const float uniform = label_smoothing / static_cast<float>(vocab) * scale;
  const float one_hot = (1.0f - label_smoothing) * scale;
  for (int64_t j = threadIdx.x; j < vocab; j += kThreads) {
    const float v = z[j];
    float grad = expf(v - lse) * p_factor - uniform - (j == label ? one_hot : 0.0f);
    if (capped) grad *= 1.0f - (v / softcap) * (v / softcap);
    z[j] = grad;
  }
}

}  // namespace

extern "C" cudaError_t hpsft_varlen_ce_rows_f32(float* logits, int64_t row_stride, const int64_t* labels,
                                                const float* row_scale, float* loss, float* zloss, float* logprob,
                                                int64_t rows, int64_t vocab, float softcap, float label_smoothing,
                                                float z_loss_weight, bool compute_grad, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  cross_entropy_rows_kernel<<<static_cast<unsigned int>(rows), kThreads, 0, stream>>>(
      logits, row_stride, labels, row_scale, loss, zloss, logprob, vocab, softcap, label_smoothing, z_loss_weight,
      compute_grad);
  return cudaGetLastError();
}
