/// @file
/// The device a rank trains on, and what this build can do with GPUs.
///
/// \code
///   auto dist = dtrain::init();
///   c10::Device dev = dtrain::selectDevice("cuda", dist.localRank());   // cuda:LOCAL_RANK (mod GPUs)
///   model->to(dev);
///   dtrain::DistributedDataParallel ddp(model, dist.world());          // CUDA tensors: NCCL or staged
/// \endcode
///
/// Every layer takes CUDA tensors where the build has CUDA (DTRAIN_CUDA, on with a CUDA libtorch) and
/// moves them the best way the group allows: NCCL where every rank has a GPU of its own, else through
/// pinned host buffers over the group's transport (tcp, shm, mpi), chosen per group on its first CUDA
/// tensor (GroupOptions::cuda_path, DTRAIN_CUDA_COMM=auto|nccl|staged). docs/GPU.md has the details.
#pragma once
#include <c10/core/Device.h>

#include <string>

namespace dtrain {

/// True when dtrain was built with CUDA (DTRAIN_CUDA=ON).
bool cudaBuilt();
/// GPUs this process can use: 0 without CUDA in the build, without a driver or without a device.
int cudaDeviceCount();
/// Why cudaDeviceCount() is 0 ("this dtrain was built without CUDA", "CUDA driver version is insufficient
/// for CUDA runtime version (error 35)", ...); "" when a GPU is there.
std::string cudaUnavailableReason();

/// "cpu", "cuda" (cuda:local_rank, modulo the GPUs visible: with more local ranks than GPUs several ranks
/// share one, and their tensors are staged through the host), "cuda:N", or "auto" (cuda when a GPU is
/// there, else cpu). InvalidArgument for anything else, and for cuda when no GPU can be used, naming why.
c10::Device selectDevice(const std::string& spec, int local_rank = 0);

}  // namespace dtrain
