// Binds the CUDA row kernel (csrc/varlen_ce_cuda_kernel.cu, C entry point) to torch tensors.

#include <torch/extension.h>

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

extern "C" cudaError_t hpsft_varlen_ce_rows_f32(float* logits, int64_t row_stride, const int64_t* labels,
                                                const float* row_scale, float* loss, float* zloss, float* logprob,
                                                int64_t rows, int64_t vocab, float softcap, float label_smoothing,
                                                float z_loss_weight, bool compute_grad, cudaStream_t stream);

namespace {

std::vector<at::Tensor> rows_forward_(at::Tensor logits, const at::Tensor& labels, const at::Tensor& row_scale,
                                      double softcap, double label_smoothing, double z_loss_weight, bool compute_grad) {
  TORCH_CHECK_VALUE(logits.is_cuda() && logits.dtype() == at::kFloat, "logits must be a float32 CUDA tensor");
  TORCH_CHECK_VALUE(logits.dim() == 2 && logits.size(1) > 0 && logits.stride(1) == 1,
                    "logits must be (rows, V), V > 0, with contiguous rows");
  const int64_t rows = logits.size(0);
  TORCH_CHECK_VALUE(labels.device() == logits.device() && labels.dtype() == at::kLong && labels.dim() == 1 &&
                        labels.size(0) == rows,
                    "labels must be int64 of shape (rows,) on the device of logits");
  TORCH_CHECK_VALUE(row_scale.device() == logits.device() && row_scale.dtype() == at::kFloat &&
                        row_scale.dim() == 1 && row_scale.size(0) == rows,
                    "row_scale must be float32 of shape (rows,) on the device of logits");
  const c10::cuda::CUDAGuard guard(logits.device());
  const auto labels_c = labels.contiguous();
  const auto scale_c = row_scale.contiguous();
  auto loss = at::empty({rows}, logits.options());
  auto zloss = at::empty({rows}, logits.options());
  auto logprob = at::empty({rows}, logits.options());
  const cudaError_t status = hpsft_varlen_ce_rows_f32(
      logits.data_ptr<float>(), logits.stride(0), labels_c.data_ptr<int64_t>(), scale_c.data_ptr<float>(),
      loss.data_ptr<float>(), zloss.data_ptr<float>(), logprob.data_ptr<float>(), rows, logits.size(1),
      static_cast<float>(softcap), static_cast<float>(label_smoothing), static_cast<float>(z_loss_weight),
      compute_grad, c10::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(status == cudaSuccess, "hpsft varlen cross-entropy CUDA kernel failed: ", cudaGetErrorString(status));
  return {loss, zloss, logprob};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rows_forward_", &rows_forward_,
        "In place on a (rows, V) float32 CUDA logit block: per-row (loss, zloss, logprob); d(logits) * row_scale "
        "written into the block when compute_grad (contract: hpsft/ops/row_options.py)");
}
