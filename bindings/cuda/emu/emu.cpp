// CPU emulation of CUDA for bindings/cuda (see emu.hpp). x86-64 System V only.
#include "emu.hpp"

#include <sys/mman.h>

#include <chrono>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <vector>

uint3 threadIdx;
uint3 blockIdx;
dim3 blockDim;
dim3 gridDim;

extern "C" void glm_emu_switch(void** save_sp, void* load_sp);
// Save the callee-saved registers, MXCSR and the x87 control word on the current stack, store the
// stack pointer in *save_sp, switch to load_sp and restore the same from there.
asm(R"(
    .text
    .globl glm_emu_switch
    .type glm_emu_switch,@function
glm_emu_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    subq $8, %rsp
    stmxcsr (%rsp)
    fnstcw 4(%rsp)
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    ldmxcsr (%rsp)
    fldcw 4(%rsp)
    addq $8, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size glm_emu_switch, .-glm_emu_switch
    .section .note.GNU-stack,"",@progbits
    .text
)");

namespace glm_emu {
namespace {

constexpr size_t kStack = 512 * 1024;
constexpr int kMaxThreads = 1024;

struct Fiber {
    void* sp = nullptr;
    char* stack = nullptr;
    bool done = false;
    uint3 tid;
    int index = 0;  // linear thread index in the block
};

struct Bar {
    int arrived = 0;
    int live = 0;
    uint64_t gen = 0;
};

std::vector<char*> g_stacks;
void* g_main_sp = nullptr;
Fiber* g_cur = nullptr;
std::vector<Fiber> g_fibers;
const std::function<void()>* g_fn = nullptr;
std::vector<unsigned char> g_smem;
Bar g_block_bar;
std::vector<Bar> g_warp_bars;
std::vector<uint64_t> g_slots;
uint64_t g_progress = 0;
int g_nthreads = 0;
bool g_in_kernel = false;

[[noreturn]] void die(const char* what) {
    std::fprintf(stderr, "glm_emu: %s (block %u,%u,%u thread %u,%u,%u)\n", what, blockIdx.x, blockIdx.y, blockIdx.z,
                 threadIdx.x, threadIdx.y, threadIdx.z);
    std::abort();
}

void yield() { glm_emu_switch(&g_cur->sp, g_main_sp); }

void complete_if_full(Bar& b) {
    if (b.arrived > 0 && b.arrived >= b.live) {
        b.arrived = 0;
        ++b.gen;
        ++g_progress;
    }
}

void barrier(Bar& b) {
    const uint64_t gen = b.gen;
    ++b.arrived;
    ++g_progress;
    complete_if_full(b);
    while (b.gen == gen) yield();
}

void fiber_entry() {
    (*g_fn)();
    g_cur->done = true;
    ++g_progress;
    --g_block_bar.live;
    complete_if_full(g_block_bar);
    Bar& wb = g_warp_bars[static_cast<size_t>(g_cur->index / 32)];
    --wb.live;
    complete_if_full(wb);
    glm_emu_switch(&g_cur->sp, g_main_sp);
    die("a finished fiber was resumed");
}

char* stack_for(size_t i) {
    while (g_stacks.size() <= i) {
        void* p = mmap(nullptr, kStack, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (p == MAP_FAILED) die("mmap of a fiber stack failed");
        g_stacks.push_back(static_cast<char*>(p));
    }
    return g_stacks[i];
}

void init_fiber(Fiber& f) {
    char* top = f.stack + kStack;  // page aligned, so 16-aligned
    uint64_t* s = reinterpret_cast<uint64_t*>(top);
    s[-1] = 0;                                                  // fiber_entry's (unused) return address
    s[-2] = reinterpret_cast<uint64_t>(&fiber_entry);           // where glm_emu_switch returns to
    for (int i = 3; i <= 8; ++i) s[-i] = 0;                     // rbp rbx r12 r13 r14 r15
    s[-9] = 0x1F80u | (uint64_t{0x037F} << 32);                 // MXCSR default, x87 control word
    f.sp = &s[-9];
}

}  // namespace

void* dyn_smem() { return g_smem.data(); }

int lane() { return g_cur->index % 32; }

void syncthreads() {
    if (!g_in_kernel) die("__syncthreads outside a kernel");
    barrier(g_block_bar);
}

void spin() { yield(); }

void syncwarp() { barrier(g_warp_bars[static_cast<size_t>(g_cur->index / 32)]); }

uint64_t shfl_raw(uint64_t v, int src) {
    const int w = g_cur->index / 32;
    g_slots[static_cast<size_t>(g_cur->index)] = v;
    Bar& b = g_warp_bars[static_cast<size_t>(w)];
    barrier(b);
    const int si = w * 32 + src;
    if (si >= g_nthreads || g_fibers[static_cast<size_t>(si)].done) die("shuffle reads a lane that does not take part");
    const uint64_t r = g_slots[static_cast<size_t>(si)];
    barrier(b);
    return r;
}

void launch(dim3 grid, dim3 block, size_t smem_bytes, const std::function<void()>& fn) {
    if (g_in_kernel) die("nested launch");
    const int n = static_cast<int>(block.x * block.y * block.z);
    if (n < 1 || n > kMaxThreads) die("bad block size");
    if (grid.x == 0 || grid.y == 0 || grid.z == 0) die("empty grid");
    g_in_kernel = true;
    g_fn = &fn;
    g_nthreads = n;
    gridDim = grid;
    blockDim = block;
    g_fibers.assign(static_cast<size_t>(n), Fiber{});
    g_slots.assign(static_cast<size_t>(n), 0);
    const int nwarps = (n + 31) / 32;
    for (unsigned bz = 0; bz < grid.z; ++bz)
        for (unsigned by = 0; by < grid.y; ++by)
            for (unsigned bx = 0; bx < grid.x; ++bx) {
                blockIdx.x = bx;
                blockIdx.y = by;
                blockIdx.z = bz;
                g_smem.assign(smem_bytes + 16, 0);
                g_block_bar = Bar{0, n, 0};
                g_warp_bars.assign(static_cast<size_t>(nwarps), Bar{});
                for (int w = 0; w < nwarps; ++w) g_warp_bars[static_cast<size_t>(w)].live = std::min(32, n - 32 * w);
                for (int i = 0; i < n; ++i) {
                    Fiber& f = g_fibers[static_cast<size_t>(i)];
                    f = Fiber{};
                    f.index = i;
                    f.tid.x = static_cast<unsigned>(i) % block.x;
                    f.tid.y = (static_cast<unsigned>(i) / block.x) % block.y;
                    f.tid.z = static_cast<unsigned>(i) / (block.x * block.y);
                    f.stack = stack_for(static_cast<size_t>(i));
                    init_fiber(f);
                }
                int remaining = n;
                while (remaining > 0) {
                    const uint64_t p0 = g_progress;
                    for (int i = 0; i < n; ++i) {
                        Fiber& f = g_fibers[static_cast<size_t>(i)];
                        if (f.done) continue;
                        g_cur = &f;
                        threadIdx = f.tid;
                        glm_emu_switch(&g_main_sp, f.sp);
                        if (f.done) --remaining;
                    }
                    if (remaining > 0 && g_progress == p0) die("deadlock: a barrier or shuffle that not every thread reaches");
                }
            }
    g_cur = nullptr;
    g_in_kernel = false;
}

}  // namespace glm_emu

// ---- runtime API ----------------------------------------------------------------------------------

struct EmuEvent {
    std::chrono::steady_clock::time_point t;
};

cudaError_t cudaMalloc(void** p, size_t n) {
    *p = std::aligned_alloc(256, ((n ? n : 1) + 255) / 256 * 256);
    return *p ? cudaSuccess : cudaErrorMemoryAllocation;
}
cudaError_t cudaFree(void* p) {
    std::free(p);
    return cudaSuccess;
}
cudaError_t cudaMallocHost(void** p, size_t n) { return cudaMalloc(p, n); }
cudaError_t cudaFreeHost(void* p) { return cudaFree(p); }
cudaError_t cudaMemcpy(void* d, const void* s, size_t n, cudaMemcpyKind) {
    if (n) std::memmove(d, s, n);
    return cudaSuccess;
}
cudaError_t cudaMemcpyAsync(void* d, const void* s, size_t n, cudaMemcpyKind k, cudaStream_t) {
    return cudaMemcpy(d, s, n, k);
}
cudaError_t cudaMemset(void* d, int v, size_t n) {
    std::memset(d, v, n);
    return cudaSuccess;
}
cudaError_t cudaMemsetAsync(void* d, int v, size_t n, cudaStream_t) { return cudaMemset(d, v, n); }
cudaError_t cudaDeviceSynchronize() { return cudaSuccess; }
cudaError_t cudaStreamSynchronize(cudaStream_t) { return cudaSuccess; }
cudaError_t cudaGetLastError() { return cudaSuccess; }
cudaError_t cudaPeekAtLastError() { return cudaSuccess; }
const char* cudaGetErrorString(cudaError_t e) { return e == cudaSuccess ? "no error" : "emulated error"; }
cudaError_t cudaGetDeviceCount(int* n) {
    *n = 1;
    return cudaSuccess;
}
cudaError_t cudaGetDevice(int* d) {
    *d = 0;
    return cudaSuccess;
}
cudaError_t cudaSetDevice(int) { return cudaSuccess; }
cudaError_t cudaGetDeviceProperties(cudaDeviceProp* p, int) {
    std::memset(p, 0, sizeof(*p));
    std::snprintf(p->name, sizeof(p->name), "CPU emulation of CUDA (bindings/cuda/emu)");
    p->multiProcessorCount = 4;
    p->totalGlobalMem = size_t{8} << 30;
    p->major = 9;
    p->minor = 0;
    p->l2CacheSize = 1 << 20;
    p->sharedMemPerBlockOptin = 227 * 1024;
    return cudaSuccess;
}
// (one thread runs every launch to completion in order: streams and their events order nothing more)
static int emu_stream_tag;
cudaError_t cudaStreamCreateWithFlags(cudaStream_t* s, unsigned) {
    *s = &emu_stream_tag;
    return cudaSuccess;
}
cudaError_t cudaStreamDestroy(cudaStream_t) { return cudaSuccess; }
cudaError_t cudaStreamWaitEvent(cudaStream_t, cudaEvent_t, unsigned) { return cudaSuccess; }
cudaError_t cudaEventCreateWithFlags(cudaEvent_t* e, unsigned) { return cudaEventCreate(e); }
cudaError_t cudaEventCreate(cudaEvent_t* e) {
    *e = new EmuEvent();
    return cudaSuccess;
}
cudaError_t cudaEventDestroy(cudaEvent_t e) {
    delete e;
    return cudaSuccess;
}
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t) {
    e->t = std::chrono::steady_clock::now();
    return cudaSuccess;
}
cudaError_t cudaEventSynchronize(cudaEvent_t) { return cudaSuccess; }
cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t a, cudaEvent_t b) {
    *ms = std::chrono::duration<float, std::milli>(b->t - a->t).count();
    return cudaSuccess;
}
cudaError_t cudaMemGetInfo(size_t* f, size_t* t) {
    *f = size_t{8} << 30;
    *t = size_t{8} << 30;
    return cudaSuccess;
}
