// Is racecheck's RAW hazard on Triton's partition-dispatch bytes a race, or a limit of how
// racecheck models named barriers? This CUDA control has the same pattern, correctly
// synchronized by the PTX rules: warps 0-3 write a byte per warp, every thread of the CTA
// passes `barrier.sync 1` (non-aligned, from two program counters, as Triton 3.6 emits it),
// warps 0-3 exit, warps 4-7 read their bytes. MODE adds what Triton's partitions add when
// they use shared memory themselves: a barrier over one partition's 128 threads before the
// write (`bar.sync 0, 128` in warps 0-3, `bar.sync 2, 128` in warps 4-7).
//
//   nvcc -arch=sm_90 -o /tmp/rnb ci/racecheck_named_barriers.cu
//   compute-sanitizer --tool racecheck --racecheck-report hazard /tmp/rnb MODE
//
// MODE 0: no partition barrier; 1: both partitions have one; 2: only warps 0-3.
// The program checks what warps 4-7 read (4, the value written), so it also fails on its
// own if the ordering were wrong.
#include <cstdio>
#include <cstdlib>

__global__ void dispatch_like(int *out, int mode) {
  __shared__ unsigned char part[8];
  __shared__ int scratch[256];
  int warp = threadIdx.x / 32;
  if (warp < 4) {
    if (mode >= 1) {
      scratch[threadIdx.x] = threadIdx.x;
      asm volatile("bar.sync 0, 128;" ::: "memory");
      out[gridDim.x * 256 + blockIdx.x * 256 + threadIdx.x] = scratch[(threadIdx.x + 32) % 128];
    }
    if (threadIdx.x < 8) part[threadIdx.x] = 4;
    asm volatile("barrier.sync 1;" ::: "memory");
  } else {
    if (mode == 1) {
      scratch[threadIdx.x] = threadIdx.x;
      asm volatile("bar.sync 2, 128;" ::: "memory");
      out[gridDim.x * 256 + blockIdx.x * 256 + threadIdx.x] =
          scratch[128 + (threadIdx.x + 32) % 128];
    }
    asm volatile("barrier.sync 1;" ::: "memory");
    out[blockIdx.x * 256 + threadIdx.x] = part[warp];
  }
}

int main(int argc, char **argv) {
  int mode = argc > 1 ? atoi(argv[1]) : 0;
  const int blocks = 264;
  int *out;
  cudaMallocManaged(&out, 2 * blocks * 256 * sizeof(int));
  for (int i = 0; i < 2 * blocks * 256; i++) out[i] = -1;
  dispatch_like<<<blocks, 256>>>(out, mode);
  cudaError_t err = cudaDeviceSynchronize();
  if (err != cudaSuccess) { printf("CUDA error: %s\n", cudaGetErrorString(err)); return 1; }
  for (int b = 0; b < blocks; b++)
    for (int t = 128; t < 256; t++)
      if (out[b * 256 + t] != 4) { printf("block %d thread %d read %d\n", b, t, out[b * 256 + t]); return 1; }
  printf("racecheck_named_barriers: mode %d, warps 4-7 read what warps 0-3 wrote\n", mode);
  return 0;
}
