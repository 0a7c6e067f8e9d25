/*
 * A CPU emulation of the small part of the CUDA execution model the normexport kernels use, so
 * that the kernel source in plugins/kernels/ runs, unchanged, on a machine without a GPU
 * (tests/test_kernels_emulated.py). Not a CUDA implementation: it checks the kernels' logic
 * (launch choices, indexing, vector packs, reductions, every lane reaching every shuffle and
 * barrier), not their speed or the GPU's memory model.
 *
 * - A launch runs its blocks one after another; the threads of a block run concurrently, one
 *   std::thread each (reused for the next block), so `__shared__` (static storage here) holds
 *   one block's data at a time.
 * - __syncthreads(): a barrier of the block's threads. __shfl_xor_sync(): each lane publishes its
 *   value (in one of two buffers, used in turn), the warp waits at a barrier, and each lane reads its
 *   partner's. A lane that misses a shuffle or a barrier the others reach would hang a GPU; here
 *   the barrier gives up after a timeout and the launch reports cudaErrorLaunchTimeout.
 * - Kernel launches `k<<<grid, block, shmem, stream>>>(args)` are rewritten by the test into
 *   `::emu::launch(k, grid, block, shmem, stream)(args)`.
 */
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include <climits>
#include <ctime>
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

// CUDA's qualifiers become plain C++.
#undef __global__
#undef __device__
#undef __forceinline__
#undef __launch_bounds__
#undef __shared__
#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __maxnreg__(...)
#define __shared__ static

// The kernels' persistent grid (a switch of norm_common.cuh, off on GPUs): with the small emulated
// GPU below, every block of a launch loops over several rows, so the row loops and the reduction
// buffer that alternates between rows are exercised (on a GPU a block loops only past 2^30 rows).
#define NORMEXPORT_PERSISTENT 1

#ifndef NORMEXPORT_EMU_TIMEOUT_MS
#define NORMEXPORT_EMU_TIMEOUT_MS 20000
#endif

namespace emu
{

// Which planted bug a test switched on (0: none): $NORMEXPORT_EMU_PLANTED at start (the sanitizer
// driver), or normexport_emu_plant() of a loaded library (the in-process planted-bug tests). The tests
// compile their planted bugs into the kernel source behind this switch, so that several planted bugs
// share one build: switched off, the edited lines compute what the source's do. Set it only between
// launches (the launch's thread creation orders the write before the kernels' reads).
inline int gPlanted = [] {
    char const* v = std::getenv("NORMEXPORT_EMU_PLANTED");
    return v ? std::atoi(v) : 0;
}();

// How long a barrier waits for the rest of its threads (NORMEXPORT_EMU_TIMEOUT_MS at build time;
// normexport_emu_plant() changes it: the planted-bug tests wait less for a lane that never comes).
inline int gTimeoutMs = NORMEXPORT_EMU_TIMEOUT_MS;

inline cudaError_t gLastError = cudaSuccess;
inline std::mutex gErrorMutex;

inline void setError(cudaError_t e)
{
    std::lock_guard<std::mutex> lock(gErrorMutex);
    if (gLastError == cudaSuccess)
    {
        gLastError = e;
    }
}

//! A reusable barrier for `n` threads that breaks (and stays broken) when a wait times out. The
//! waiters sleep on the generation counter with a futex and the last thread to arrive wakes them all:
//! each waiter wakes once and goes on (a mutex + condition variable makes every woken thread queue
//! again for the mutex, about twice the context switches, the emulation's main cost). The atomics'
//! acquire / release order what each thread wrote before the barrier before what the others read
//! after it (ThreadSanitizer sees that synchronisation, and nothing more).
class Barrier
{
public:
    explicit Barrier(unsigned n)
        : mCount(n)
    {
    }
    void arrive_and_wait()
    {
        if (mBroken.load(std::memory_order_acquire))
        {
            return;
        }
        uint32_t const generation = mGeneration.load(std::memory_order_acquire);
        if (mWaiting.fetch_add(1, std::memory_order_acq_rel) + 1 == mCount)
        {
            // no thread arrives for the next generation before this one ends: the count restarts here
            mWaiting.store(0, std::memory_order_relaxed);
            mGeneration.fetch_add(1, std::memory_order_acq_rel);
            wakeAll();
            return;
        }
        auto const deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(gTimeoutMs);
        while (mGeneration.load(std::memory_order_acquire) == generation)
        {
            if (mBroken.load(std::memory_order_acquire))
            {
                return;
            }
            auto const left = deadline - std::chrono::steady_clock::now();
            if (left <= std::chrono::nanoseconds::zero())
            {
                mBroken.store(true, std::memory_order_release);
                wakeAll();
                setError(cudaErrorLaunchTimeout);
                return;
            }
            auto const ns = std::chrono::duration_cast<std::chrono::nanoseconds>(left).count();
            timespec const ts{static_cast<time_t>(ns / 1000000000), static_cast<long>(ns % 1000000000)};
            // sleeps only while the generation is still `generation` (else returns at once), up to `ts`
            syscall(SYS_futex, reinterpret_cast<uint32_t*>(&mGeneration), FUTEX_WAIT_PRIVATE, generation, &ts,
                nullptr, 0);
        }
    }

private:
    void wakeAll()
    {
        syscall(SYS_futex, reinterpret_cast<uint32_t*>(&mGeneration), FUTEX_WAKE_PRIVATE, INT32_MAX, nullptr,
            nullptr, 0);
    }

    unsigned const mCount;
    std::atomic<unsigned> mWaiting{0};
    std::atomic<uint32_t> mGeneration{0};
    std::atomic<bool> mBroken{false};
    static_assert(sizeof(std::atomic<uint32_t>) == sizeof(uint32_t), "the futex word is the atomic itself");
};

struct Block
{
    Barrier block;      // __syncthreads
    Barrier blockDone;  // end of one block, before the same threads start the next one
    std::vector<std::unique_ptr<Barrier>> warps;
    std::vector<float> lanes[2];          // the shuffles' values, two buffers used in turn
    std::vector<unsigned char> shuffles;  // per thread: which buffer its next shuffle uses
    std::vector<uint4> dynamic;           // the launch's dynamic shared memory (exactly its size)
    Block(unsigned n, size_t dynamicBytes)
        : block(n)
        , blockDone(n)
        , lanes{std::vector<float>(n), std::vector<float>(n)}
        , shuffles(n)
        , dynamic((dynamicBytes + sizeof(uint4) - 1) / sizeof(uint4))
    {
        for (unsigned w = 0; w < (n + 31) / 32; ++w)
        {
            warps.push_back(std::make_unique<Barrier>(std::min(32u, n - 32u * w)));
        }
    }
};

inline thread_local uint3 tIdx{};
inline thread_local uint3 bIdx{};
inline thread_local Block* tBlock = nullptr;
inline dim3 gBlockDim{};
inline dim3 gGridDim{};

template <typename Kernel>
struct Launch
{
    Kernel kernel;
    unsigned grid;
    unsigned block;
    size_t shmem;

    template <typename... Args>
    void operator()(Args... args) const
    {
        if (block == 0 || block > 1024 || grid == 0)
        {
            setError(cudaErrorInvalidConfiguration);
            return;
        }
        gGridDim = dim3(grid, 1, 1);
        gBlockDim = dim3(block, 1, 1);
        // One host thread per CUDA thread of a block; the same threads run the blocks one after
        // another, meeting at blockDone between them (so `__shared__` data is one block's at a time).
        Block shared(block, shmem);
        std::vector<std::thread> threads;
        threads.reserve(block);
        for (unsigned t = 0; t < block; ++t)
        {
            threads.emplace_back([&, t] {
                tIdx = make_uint3(t, 0, 0);
                tBlock = &shared;
                for (unsigned b = 0; b < grid; ++b)
                {
                    bIdx = make_uint3(b, 0, 0);
                    kernel(args...);
                    shared.blockDone.arrive_and_wait();
                }
            });
        }
        for (auto& th : threads)
        {
            th.join();
        }
    }
};

template <typename Kernel>
Launch<Kernel> launch(Kernel kernel, unsigned grid, unsigned block, size_t shmem, cudaStream_t /*stream*/)
{
    return Launch<Kernel>{kernel, grid, block, shmem};
}

// Each lane publishes its value in one of two buffers (alternating per shuffle), the warp meets at
// one barrier, and each lane reads its partner's. One barrier is enough: a lane can write the same
// buffer again only two shuffles later, after the next shuffle's barrier, which every lane reaches
// only after reading this one's value.
inline float shfl_xor(float v, int laneMask)
{
    Block& b = *tBlock;
    unsigned const t = tIdx.x;
    auto& warp = *b.warps[t / 32];
    std::vector<float>& lanes = b.lanes[b.shuffles[t]];
    b.shuffles[t] ^= 1;
    lanes[t] = v;
    warp.arrive_and_wait();
    unsigned const partner = (t & ~31u) | ((t & 31u) ^ static_cast<unsigned>(laneMask));
    if (partner >= lanes.size()) // a lane that does not exist: undefined on a GPU
    {
        setError(cudaErrorIllegalInstruction);
        return v;
    }
    return lanes[partner];
}

} // namespace emu

#undef threadIdx
#undef blockIdx
#undef blockDim
#undef gridDim
#define threadIdx (::emu::tIdx)
#define blockIdx (::emu::bIdx)
#define blockDim (::emu::gBlockDim)
#define gridDim (::emu::gGridDim)

// `extern __shared__` memory of the launch (norm_common.cuh's dynamic_smem() on a GPU): one block's
// at a time, like `__shared__`.
#define NORMEXPORT_EMU_DYNAMIC_SMEM 1
inline uint4* dynamic_smem()
{
    return emu::tBlock->dynamic.data();
}

extern "C" cudaError_t cudaFuncSetAttribute(void const* /*func*/, cudaFuncAttribute /*attr*/, int /*value*/)
{
    return cudaSuccess;
}

inline void __syncthreads()
{
    emu::tBlock->block.arrive_and_wait();
}

inline float __shfl_xor_sync(unsigned mask, float v, int laneMask)
{
    if (mask != 0xffffffffu) // only full-warp shuffles are modelled (every lane must arrive)
    {
        emu::setError(cudaErrorNotSupported);
    }
    return emu::shfl_xor(v, laneMask);
}

template <typename T>
inline T __ldg(T const* p)
{
    return *p;
}

#define rsqrtf(x) (1.0f / std::sqrt(static_cast<float>(x)))
#define __fdividef(a, b) (static_cast<float>(a) / static_cast<float>(b))

// The planted-bug switch of a library built with switched plants (tests/test_kernels_emulated.py):
// bug `planted` on (0: off) and barriers that give up after `timeout_ms` (<= 0: the build's default).
extern "C" void normexport_emu_plant(int planted, int timeout_ms)
{
    emu::gPlanted = planted;
    emu::gTimeoutMs = timeout_ms > 0 ? timeout_ms : NORMEXPORT_EMU_TIMEOUT_MS;
}

// The persistent grid's size: a small GPU (2 SMs, one resident block each), so that the blocks of
// a launch loop over several rows (the row loops, the alternating reduction buffer and the
// prefetch of the next row are exercised).
extern "C" cudaError_t cudaGetDevice(int* device)
{
    *device = 0;
    return cudaSuccess;
}

extern "C" cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int /*device*/)
{
    *value = attr == cudaDevAttrMultiProcessorCount ? 2 : 0;
    return cudaSuccess;
}

extern "C" cudaError_t cudaOccupancyMaxActiveBlocksPerMultiprocessor(
    int* numBlocks, void const* /*func*/, int /*blockSize*/, size_t /*dynamicSMemSize*/)
{
    *numBlocks = 1;
    return cudaSuccess;
}

extern "C" cudaError_t cudaGetLastError(void)
{
    std::lock_guard<std::mutex> lock(emu::gErrorMutex);
    cudaError_t const e = emu::gLastError;
    emu::gLastError = cudaSuccess;
    return e;
}

extern "C" char const* cudaGetErrorString(cudaError_t e)
{
    return e == cudaErrorLaunchTimeout ? "emulated launch timed out (a thread missed a barrier or shuffle)"
                                       : "emulated CUDA error";
}
