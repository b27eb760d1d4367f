// The CPU harness's runtime: device memory with guards, the block scheduler (threads as
// cooperative fibers), barriers, warp shuffles, per-block shared memory, and the memory-access
// hooks that the sanitizer instrumentation of the kernel modules calls. See README.md.
//
// Built once by cudaemu/__init__.py into a shared library loaded RTLD_GLOBAL; kernel modules
// resolve cudaemu_* and __tsan_* against it. One launch runs at a time (Python holds a lock).
#include <sys/mman.h>
#include <ucontext.h>
#include <dlfcn.h>
#include <unistd.h>

#include <algorithm>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <deque>
#include <map>
#include <string>
#include <unordered_map>
#include <vector>

namespace {

// error kinds, mirrored by cudaemu/__init__.py
enum ErrorKind {
    OK = 0,
    KERNEL_ERROR = 1,
    RACE = 2,
    SHARED_BOUNDS = 3,
    UNINITIALIZED_SHARED = 4,
    GLOBAL_BOUNDS = 5,
    DEADLOCK = 6,
    PARTIAL_WARP = 7,
    LAUNCH = 8,
    INTEGER_OVERFLOW = 9,
};

struct uint3_ {
    unsigned int x, y, z;
};
struct Builtins {
    uint3_ threadIdx, blockIdx, blockDim, gridDim;
    int warpSize;
};

}  // namespace

extern "C" {
struct cudaemu_error {
    int kind;
    int has_pc;
    unsigned long long pc_offset;  // into the module shared object named by `object`
    char object[1024];
    char message[4096];
};
const Builtins* cudaemu_vars = nullptr;
}

namespace {

const size_t PAGE = 4096;

// ---------------------------------------------------------------------------- device memory
// One reserved address range is "device memory". Every allocation starts on a page boundary
// and is followed by at least one page that is never mapped; an access anywhere in the range
// that is not inside a live allocation's payload is reported (reads and writes alike).
const size_t DEVICE_RESERVE = size_t(1) << 38;
uintptr_t dev_base = 0, dev_bump = 0;
struct GlobalShadow {  // per byte of an allocation, during one launch
    uint32_t write_epoch, read_epoch;
    int32_t writer, reader;  // global thread ids; reader -2: several threads in read_epoch
    int32_t read_block;      // -2: reads from several blocks
};
struct Allocation {
    size_t nbytes;
    size_t pages;
    bool live;
    std::vector<GlobalShadow> shadow;  // filled on first access in a launch, dropped after it
};
std::map<uintptr_t, Allocation> allocations;
std::deque<uintptr_t> quarantine;  // freed, not yet reusable (use-after-free stays detectable)
std::multimap<size_t, uintptr_t> reusable;  // pages -> start
const size_t QUARANTINE = 4096;

bool device_init() {
    if (dev_base) return true;
    void* p = mmap(nullptr, DEVICE_RESERVE, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) return false;
    dev_base = reinterpret_cast<uintptr_t>(p);
    dev_bump = dev_base + PAGE;  // a guard page before the first allocation
    return true;
}

const Allocation* find_allocation(uintptr_t addr, uintptr_t* start) {
    auto it = allocations.upper_bound(addr);
    if (it == allocations.begin()) return nullptr;
    --it;
    if (addr >= it->first + it->second.pages * PAGE) return nullptr;
    *start = it->first;
    return &it->second;
}

// ---------------------------------------------------------------------------- shared memory
// One arena per launch: [redzone][dynamic][redzone][static var][redzone]... Payload bytes are
// marked valid; a byte's shadow records the epoch (barrier interval) and thread of its last
// write and of its readers, so any two accesses by different threads in one epoch, at least
// one a write, are a race whatever order the fibers ran in. Epochs never repeat within a
// launch, so "written in this block" is "written at an epoch >= the block's first".
const size_t ARENA = size_t(1) << 20;
const size_t REDZONE = 256;
uint8_t* arena = nullptr;
struct Shadow {
    uint32_t write_epoch, read_epoch;
    int32_t writer, reader;  // reader -2: several threads read in read_epoch
};
std::vector<Shadow> shadow;
std::vector<uint8_t> valid;
struct SharedVar {
    size_t offset, size;
    std::string name;
    int line;
};
std::vector<SharedVar> shared_vars;
struct Pending {
    size_t byte;
    int tid;
    void* pc;
};
std::vector<Pending> pending_uninitialized;  // reads of never-written bytes in the current epoch
std::unordered_map<const void*, size_t> shared_by_tag;  // -> index into shared_vars
size_t arena_cursor = 0, static_shared_bytes = 0, dynamic_offset = 0, dynamic_bytes = 0, shared_limit = 0;

// ---------------------------------------------------------------------------- context switches
// A fiber switch saves the callee-saved registers and the floating-point control words on the
// old stack and restores them from the new one: no system call (ucontext's swapcontext saves
// the signal mask, a syscall per switch, which dominated the run time). Other architectures
// fall back to ucontext.
#if defined(__x86_64__)
extern "C" void cudaemu_switch(void** save_sp, void* load_sp);
asm(R"(
    .text
    .globl cudaemu_switch
    .type cudaemu_switch, @function
cudaemu_switch:
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
    .size cudaemu_switch, .-cudaemu_switch
)");

struct Context {
    void* sp = nullptr;
};

// A fresh context that starts in entry() on [stack, stack + size) (entry never returns).
void context_init(Context& c, uint8_t* stack, size_t size, void (*entry)()) {
    uintptr_t top = (reinterpret_cast<uintptr_t>(stack) + size) & ~uintptr_t(15);
    uint64_t* sp = reinterpret_cast<uint64_t*>(top);
    *--sp = 0;                                   // keeps entry's frame 16-byte aligned, as after a call
    *--sp = reinterpret_cast<uint64_t>(entry);   // where the switch's `ret` goes
    for (int i = 0; i < 6; ++i) *--sp = 0;       // rbp rbx r12 r13 r14 r15
    uint32_t mxcsr;
    uint16_t fpucw;
    asm volatile("stmxcsr %0" : "=m"(mxcsr));
    asm volatile("fnstcw %0" : "=m"(fpucw));
    *--sp = uint64_t(mxcsr) | (uint64_t(fpucw) << 32);
    c.sp = sp;
}

inline void context_switch(Context& from, Context& to) { cudaemu_switch(&from.sp, to.sp); }
#else
struct Context {
    ucontext_t uc;
};

void context_init(Context& c, uint8_t* stack, size_t size, void (*entry)()) {
    getcontext(&c.uc);
    c.uc.uc_stack.ss_sp = stack;
    c.uc.uc_stack.ss_size = size;
    c.uc.uc_link = nullptr;
    makecontext(&c.uc, entry, 0);
}

inline void context_switch(Context& from, Context& to) { swapcontext(&from.uc, &to.uc); }
#endif

// ---------------------------------------------------------------------------- fibers
enum FiberState { RUNNABLE, AT_BARRIER, AT_SHUFFLE, DONE };
const size_t STACK = 128 * 1024;
struct Fiber {
    Context ctx;
    uint8_t* stack = nullptr;  // STACK bytes plus a guard page below
    Builtins vars;
    int tid;
    FiberState state;
    int line;  // barrier or shuffle line it waits at
    // shuffle
    int kind, arg, width;
    unsigned long long mask, value, result;
};
std::vector<Fiber> fibers;
Context scheduler_ctx;
Fiber* current = nullptr;
std::deque<int> run_queue;
int nthreads = 0, warp_size = 32, barrier_arrivals = 0;
uint32_t epoch = 1, block_first_epoch = 1;
bool in_launch = false, aborting = false;
uint32_t launch_first_epoch = 1;
bool check_global_races = true;  // off when grid x block threads do not fit the shadow's int32 ids
long long block_linear = 0;
std::vector<size_t> only_blocks;  // set by cudaemu_only_blocks for the next launch: run just these
std::vector<Allocation*> shadowed;  // allocations with a global shadow in this launch
uintptr_t hit_start = 0;            // the allocation of the previous access (reset per launch:
Allocation* hit = nullptr;          // allocations change only between launches)
// global-memory bytes the kernels read and wrote, every access counted (no cache is modelled):
// the traffic a kernel's tile plan implies, checked against the plan's own count
unsigned long long global_bytes_read = 0, global_bytes_written = 0;
std::string unsupported;  // a construct met while a module loads, taken by cudaemu_take_unsupported
void (*thunk)(void**) = nullptr;
void** thunk_args = nullptr;
cudaemu_error* err = nullptr;
std::vector<unsigned long long> warp_arrived;  // per warp: lanes waiting at a shuffle

// deterministic generator for the randomised schedule (splitmix64)
bool seeded = false;
uint64_t rng_state = 0;
constexpr int CUDAEMU_FRAGMENT_KINDS = 5;  // matrix_a row/col major, matrix_b row/col major, accumulator
// WMMA fragments (include/mma.h): which matrix element each (lane, element) of a fragment holds is
// unspecified by CUDA, so the harness draws the map at random, per launch and per fragment kind:
// map[lane * 8 + e] = row * 16 + col. Code that assumes a layout reads the wrong elements.
unsigned char fragment_maps[CUDAEMU_FRAGMENT_KINDS][256];
uint64_t fragment_launches = 0, fragment_seed = 0;
bool fragment_maps_drawn = false;
uint64_t next_random() {
    uint64_t z = (rng_state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

std::string format(const char* fmt, ...) {
    char buf[2048];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    return buf;
}

std::string thread_name(int tid) {
    const Fiber& f = fibers[tid];
    const Builtins& b = f.vars;
    std::string s = format("thread (%u,%u,%u)", b.threadIdx.x, b.threadIdx.y, b.threadIdx.z);
    if (b.blockDim.y == 1 && b.blockDim.z == 1) s = format("thread %u", b.threadIdx.x);
    return s;
}

std::string block_name() {
    const Builtins& b = fibers[0].vars;
    return format("block (%u,%u,%u)", b.blockIdx.x, b.blockIdx.y, b.blockIdx.z);
}

std::string ranges(const std::vector<int>& tids) {
    std::string s;
    for (size_t i = 0; i < tids.size();) {
        size_t j = i;
        while (j + 1 < tids.size() && tids[j + 1] == tids[j] + 1) ++j;
        if (!s.empty()) s += ", ";
        s += (i == j) ? format("%d", tids[i]) : format("%d-%d", tids[i], tids[j]);
        i = j + 1;
    }
    return s;
}

void set_pc(void* pc) {
    Dl_info info;
    if (pc && dladdr(pc, &info) && info.dli_fname) {
        err->has_pc = 1;
        // return addresses point after the call: one byte back is inside the access's line
        err->pc_offset = reinterpret_cast<uintptr_t>(pc) - 1 - reinterpret_cast<uintptr_t>(info.dli_fbase);
        snprintf(err->object, sizeof err->object, "%s", info.dli_fname);
    }
}

// Records the error and abandons the running fiber (its block never resumes).
[[noreturn]] void fail(int kind, const std::string& message, void* pc = nullptr) {
    if (!aborting) {
        err->kind = kind;
        snprintf(err->message, sizeof err->message, "%s: %s", block_name().c_str(), message.c_str());
        set_pc(pc);
        aborting = true;
    }
    context_switch(current->ctx, scheduler_ctx);
    __builtin_unreachable();
}

// An error found by the scheduler itself (no fiber running).
void fail_outside(int kind, const std::string& message, void* pc = nullptr) {
    if (aborting) return;
    err->kind = kind;
    snprintf(err->message, sizeof err->message, "%s: %s", block_name().c_str(), message.c_str());
    set_pc(pc);
    aborting = true;
}

std::string shared_name(size_t b, size_t* at) {
    for (const SharedVar& v : shared_vars)
        if (b >= v.offset && b < v.offset + v.size) {
            *at = b - v.offset;
            return v.name;
        }
    *at = 0;
    return "?";
}

// At the end of an epoch (a barrier, or the block's end): the reads of bytes no thread had
// written when they were read. A write later in the epoch does not excuse the read: by another
// thread it is a race (reported at that write), by the reading thread itself it is a
// read-modify-write of uninitialised memory (`s[i] += v` on a never-written `s`).
std::string uninitialized_report(void** pc) {
    for (const Pending& p : pending_uninitialized) {
        size_t at = 0;
        const std::string name = shared_name(p.byte, &at);
        *pc = p.pc;
        return format("%s: read of shared `%s` (byte %zu) that no thread of this block has written",
                      thread_name(p.tid).c_str(), name.c_str(), at);
    }
    pending_uninitialized.clear();
    return "";
}

void yield() { context_switch(current->ctx, scheduler_ctx); }

void make_runnable(Fiber& f) {
    f.state = RUNNABLE;
    run_queue.push_back(f.tid);
}

// With a seed, a thread may be preempted at any memory access, not only at barriers/shuffles.
void maybe_preempt() {
    if (seeded && (next_random() & 7) == 0) {
        run_queue.push_back(current->tid);
        yield();
    }
}

// ---------------------------------------------------------------------------- access checks
void shared_access(uintptr_t addr, size_t size, bool write, void* pc) {
    const size_t off = addr - reinterpret_cast<uintptr_t>(arena);
    const int tid = current->tid;
    const char* what = write ? "write" : "read";
    for (size_t b = off; b < off + size; ++b) {
        if (b >= ARENA || !valid[b]) {
            // name the nearest variable for the message
            std::string near = "no shared variable";
            size_t best = SIZE_MAX;
            for (const SharedVar& v : shared_vars) {
                size_t d = b < v.offset ? v.offset - b : (b >= v.offset + v.size ? b - (v.offset + v.size) + 1 : 0);
                if (d < best) {
                    best = d;
                    if (b < v.offset)
                        near = format("%zu bytes before `%s` (%zu bytes)", d, v.name.c_str(), v.size);
                    else
                        near = format("%zu bytes past the end of `%s` (%zu bytes)", d - 1, v.name.c_str(), v.size);
                }
            }
            fail(SHARED_BOUNDS, format("%s: out-of-bounds shared-memory %s of %zu bytes, %s", thread_name(tid).c_str(),
                                       what, size, near.c_str()),
                 pc);
        }
    }
    for (size_t b = off; b < off + size; ++b) {
        Shadow& s = shadow[b];
        const bool written_here = s.write_epoch >= block_first_epoch;
        if (!write && !written_here) {
            // decided when the epoch ends: a write by another thread later in this epoch makes
            // it a race (whatever the order), none makes it a read of uninitialised memory
            if (s.read_epoch != epoch) pending_uninitialized.push_back(Pending{b, tid, pc});
        }
        int other = -1;
        const char* conflict = nullptr;
        if (s.write_epoch == epoch && written_here && s.writer != tid) {
            other = s.writer;
            conflict = "wrote";
        } else if (write && s.read_epoch == epoch && s.read_epoch >= block_first_epoch && s.reader != tid) {
            other = s.reader;
            conflict = "read";
        }
        if (conflict) {
            size_t at = 0;
            const std::string name = shared_name(b, &at);
            std::string who = other >= 0 ? thread_name(other) : std::string("other threads");
            fail(RACE,
                 format("shared-memory race on `%s` (byte %zu): %s %ss it, %s %s it, with no __syncthreads() between",
                        name.c_str(), at, thread_name(tid).c_str(), what, who.c_str(), conflict),
                 pc);
        }
        if (write) {
            s.write_epoch = epoch;
            s.writer = tid;
        } else if (s.read_epoch != epoch || s.read_epoch < block_first_epoch) {
            s.read_epoch = epoch;
            s.reader = tid;
        } else if (s.reader != tid) {
            s.reader = -2;
        }
    }
}

// Global memory: two threads of one launch touching a byte, one writing, is a race unless they
// are in the same block with a __syncthreads() between (blocks cannot synchronise in a launch).
std::string global_thread_name(long long gid) {
    const long long b = gid / nthreads, t = gid % nthreads;
    if (b == block_linear) return thread_name(static_cast<int>(t));
    return format("thread %lld of block %lld (linear)", t, b);
}

void global_race_check(Allocation& a, uintptr_t start, uintptr_t addr, size_t size, bool write, void* pc) {
    if (a.shadow.empty()) {
        a.shadow.assign(std::max<size_t>(a.nbytes, 1), GlobalShadow{0, 0, -1, -1, -1});
        shadowed.push_back(&a);
    }
    const long long gid = block_linear * nthreads + current->tid;
    const int32_t block = static_cast<int32_t>(block_linear);
    for (size_t i = addr - start; i < addr - start + size; ++i) {
        GlobalShadow& g = a.shadow[i];
        const bool written = g.write_epoch >= launch_first_epoch && g.writer != gid;
        const bool w_conflict = written && (g.writer / nthreads != block_linear || g.write_epoch == epoch);
        bool r_conflict = false;
        if (write && g.read_epoch >= launch_first_epoch)
            r_conflict = g.read_block != block || (g.read_epoch == epoch && g.reader != gid);
        if (w_conflict || r_conflict) {
            const long long other = w_conflict ? g.writer : g.reader;
            const std::string who = other >= 0 ? global_thread_name(other) : std::string("other threads");
            const std::string where = (w_conflict ? g.writer / nthreads != block_linear : g.read_block != block)
                                          ? "in another block (blocks do not synchronise within a launch)"
                                          : "with no __syncthreads() between";
            fail(RACE, format("global-memory race at byte %zu of the %zu-byte allocation at 0x%llx: %s %ss it, %s %s it %s",
                              i, a.nbytes, (unsigned long long)start, thread_name(current->tid).c_str(),
                              write ? "write" : "read", who.c_str(), w_conflict ? "wrote" : "read", where.c_str()),
                 pc);
        }
        if (write) {
            g.write_epoch = epoch;
            g.writer = static_cast<int32_t>(gid);
        } else if (g.read_epoch < launch_first_epoch) {
            g.read_epoch = epoch, g.reader = static_cast<int32_t>(gid), g.read_block = block;
        } else if (g.read_block != block) {
            g.read_epoch = epoch, g.reader = static_cast<int32_t>(gid), g.read_block = -2;
        } else if (g.read_epoch == epoch) {
            if (g.reader != gid) g.reader = -2;
        } else {
            g.read_epoch = epoch, g.reader = static_cast<int32_t>(gid);
        }
    }
}

void global_access(uintptr_t addr, size_t size, bool write, void* pc) {
    const char* what = write ? "write" : "read";
    // the allocation of the previous access first: kernels stream through a few buffers
    uintptr_t start = hit_start;
    Allocation* a = hit;
    if (!(a && addr >= start && addr + size <= start + a->nbytes && a->live))
        a = const_cast<Allocation*>(find_allocation(addr, &start));
    if (a && a->live && addr + size <= start + a->nbytes) {
        hit = a, hit_start = start;
        (write ? global_bytes_written : global_bytes_read) += size;
        if (check_global_races) global_race_check(*a, start, addr, size, write, pc);
        return;
    }
    std::string where;
    if (a && !a->live) {
        where = format("inside a freed allocation of %zu bytes at 0x%llx", a->nbytes, (unsigned long long)start);
    } else if (a) {
        const uintptr_t end = start + a->nbytes;
        where = addr >= end ? format("%llu bytes past the end of the %zu-byte allocation at 0x%llx",
                                     (unsigned long long)(addr - end), a->nbytes, (unsigned long long)start)
                            : format("running %llu bytes past the end of the %zu-byte allocation at 0x%llx",
                                     (unsigned long long)(addr + size - end), a->nbytes, (unsigned long long)start);
    } else {
        // in a guard page before an allocation?
        auto it = allocations.upper_bound(addr);
        if (it != allocations.end())
            where = format("%llu bytes before the %zu-byte allocation at 0x%llx", (unsigned long long)(it->first - addr),
                           it->second.nbytes, (unsigned long long)it->first);
        else
            where = "outside every allocation";
    }
    fail(GLOBAL_BOUNDS,
         format("%s: out-of-bounds global %s of %zu bytes at 0x%llx, %s", thread_name(current->tid).c_str(), what, size,
                (unsigned long long)addr, where.c_str()),
         pc);
}

inline void access(const void* p, size_t size, bool write, void* pc) {
    if (!in_launch || !current || aborting) return;
    const uintptr_t addr = reinterpret_cast<uintptr_t>(p);
    const bool shared = addr - reinterpret_cast<uintptr_t>(arena) < ARENA;
    const bool global = !shared && addr - dev_base < DEVICE_RESERVE;
    if (!shared && !global) return;  // the thread's own stack, the harness's variables
    if (size > 1 && (addr & (size - 1)) != 0)
        fail(shared ? SHARED_BOUNDS : GLOBAL_BOUNDS,
             format("%s: misaligned %zu-byte %s at 0x%llx (a GPU faults on it)", thread_name(current->tid).c_str(), size,
                    write ? "write" : "read", (unsigned long long)addr),
             pc);
    if (shared)
        shared_access(addr, size, write, pc);
    else
        global_access(addr, size, write, pc);
    maybe_preempt();
}

// ---------------------------------------------------------------------------- fibers and blocks
void fiber_main() {
    Fiber& f = *current;
    const int tid = f.tid;
    thunk(thunk_args);
    f.state = DONE;
    // a lane leaving while its warp waits for it at a shuffle
    const int warp = tid / warp_size, lane = tid % warp_size;
    for (int t = warp * warp_size; t < std::min(nthreads, (warp + 1) * warp_size); ++t) {
        const Fiber& g = fibers[t];
        if (g.state == AT_SHUFFLE && (g.mask >> lane & 1ull))
            fail(PARTIAL_WARP, format("%s exited while %s waits for it at the shuffle on line %d", thread_name(tid).c_str(),
                                      thread_name(t).c_str(), g.line));
    }
    context_switch(f.ctx, scheduler_ctx);
    __builtin_unreachable();
}

void diagnose_stall() {
    std::map<int, std::vector<int>> at_barrier, at_shuffle;
    std::vector<int> done;
    for (int t = 0; t < nthreads; ++t) {
        const Fiber& f = fibers[t];
        if (f.state == AT_BARRIER) at_barrier[f.line].push_back(f.tid);
        if (f.state == AT_SHUFFLE) at_shuffle[f.line].push_back(f.tid);
        if (f.state == DONE) done.push_back(f.tid);
    }
    std::string parts;
    for (auto& kv : at_barrier)
        parts += format("; threads %s wait at __syncthreads() on line %d", ranges(kv.second).c_str(), kv.first);
    for (auto& kv : at_shuffle)
        parts += format("; threads %s wait at the shuffle on line %d", ranges(kv.second).c_str(), kv.first);
    if (!done.empty()) parts += format("; threads %s have exited", ranges(done).c_str());
    fail_outside(DEADLOCK, "deadlock: a barrier or shuffle some threads never reach" + parts);
}

void run_block(const uint3_& block_idx, const uint3_& grid, const uint3_& block) {
    block_first_epoch = ++epoch;
    barrier_arrivals = 0;
    std::fill(warp_arrived.begin(), warp_arrived.end(), 0ull);
    // poison every shared byte: NaN for floats, and never "written in this block"
    for (const SharedVar& v : shared_vars) memset(arena + v.offset, 0xff, v.size);
    run_queue.clear();
    pending_uninitialized.clear();
    for (int t = 0; t < nthreads; ++t) {
        Fiber& f = fibers[t];
        f.tid = t;
        f.vars.threadIdx = {t % block.x, (t / block.x) % block.y, t / (block.x * block.y)};
        f.vars.blockIdx = block_idx;
        f.vars.blockDim = block;
        f.vars.gridDim = grid;
        f.vars.warpSize = warp_size;
        f.state = RUNNABLE;
        context_init(f.ctx, f.stack + PAGE, STACK, fiber_main);
        run_queue.push_back(t);
    }
    int done = 0;
    while (!aborting) {
        if (run_queue.empty()) {
            if (done < nthreads) diagnose_stall();
            break;
        }
        size_t pick = 0;
        if (seeded) pick = next_random() % run_queue.size();
        const int t = run_queue[pick];
        run_queue.erase(run_queue.begin() + pick);
        current = &fibers[t];
        cudaemu_vars = &current->vars;
        context_switch(scheduler_ctx, current->ctx);
        if (!aborting && current->state == DONE) ++done;
    }
    if (!aborting) {
        void* pc = nullptr;
        const std::string uninitialized = uninitialized_report(&pc);
        if (!uninitialized.empty()) fail_outside(UNINITIALIZED_SHARED, uninitialized, pc);
    }
    current = nullptr;
}

}  // namespace

// ---------------------------------------------------------------------------- C API for Python
extern "C" {

unsigned long long cudaemu_alloc(unsigned long long nbytes) {
    if (!device_init()) return 0;
    const size_t pages = std::max<size_t>(1, (nbytes + PAGE - 1) / PAGE);
    uintptr_t start = 0;
    auto it = reusable.find(pages);
    if (it != reusable.end()) {
        start = it->second;
        reusable.erase(it);
        allocations.erase(start);
    } else {
        if (dev_bump + (pages + 1) * PAGE > dev_base + DEVICE_RESERVE) return 0;
        start = dev_bump;
        dev_bump += (pages + 1) * PAGE;  // the page after stays PROT_NONE
    }
    if (mprotect(reinterpret_cast<void*>(start), pages * PAGE, PROT_READ | PROT_WRITE) != 0) return 0;
    allocations[start] = Allocation{nbytes, pages, true};
    return start;
}

// What a module did while loading that the harness cannot emulate ("" if nothing); clears it.
const char* cudaemu_take_unsupported() {
    static std::string taken;
    taken.swap(unsupported);
    unsupported.clear();
    return taken.c_str();
}

// 0: freed; 1: not an allocation's start; 2: already freed
int cudaemu_free(unsigned long long ptr) {
    auto it = allocations.find(ptr);
    if (it == allocations.end()) return 1;
    if (!it->second.live) return 2;
    it->second.live = false;
    madvise(reinterpret_cast<void*>(ptr), it->second.pages * PAGE, MADV_DONTNEED);  // reads as zeros from now on
    quarantine.push_back(ptr);
    if (quarantine.size() > QUARANTINE) {
        const uintptr_t old = quarantine.front();
        quarantine.pop_front();
        reusable.emplace(allocations[old].pages, old);
    }
    return 0;
}

// The live allocation holding ptr: its start and size; 0 when there is none.
int cudaemu_lookup(unsigned long long ptr, unsigned long long* start, unsigned long long* nbytes) {
    uintptr_t s = 0;
    const Allocation* a = find_allocation(ptr, &s);
    if (!a || !a->live || ptr >= s + std::max<size_t>(a->nbytes, 1)) return 0;
    *start = s;
    *nbytes = a->nbytes;
    return 1;
}

// Global bytes read and written by launches since the last reset; `reset` zeroes the counts.
void cudaemu_global_bytes(unsigned long long* read, unsigned long long* written, int reset) {
    *read = global_bytes_read;
    *written = global_bytes_written;
    if (reset) global_bytes_read = global_bytes_written = 0;
}

unsigned long long cudaemu_live_bytes() {
    unsigned long long total = 0;
    for (auto& kv : allocations)
        if (kv.second.live) total += kv.second.nbytes;
    return total;
}

int cudaemu_launch(void (*entry)(void**), void** args, const unsigned* grid3, const unsigned* block3,
                   unsigned long long dyn_shared, unsigned long long shared_limit_bytes, int warp, int use_seed,
                   unsigned long long seed, cudaemu_error* error) {
    err = error;
    memset(err, 0, sizeof *err);
    if (!device_init()) {
        err->kind = LAUNCH;
        snprintf(err->message, sizeof err->message, "cannot reserve the emulated device memory");
        return err->kind;
    }
    if (!arena) {
        arena = static_cast<uint8_t*>(mmap(nullptr, ARENA, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
        shadow.assign(ARENA, Shadow{0, 0, -1, -1});
        valid.assign(ARENA, 0);
    }
    thunk = entry;
    thunk_args = args;
    warp_size = warp;
    seeded = use_seed != 0;
    rng_state = seed;
    fragment_maps_drawn = false;  // WMMA fragment maps: drawn anew at the launch's first use
    fragment_seed = seeded ? seed : 0;
    const uint3_ grid{grid3[0], grid3[1], grid3[2]}, block{block3[0], block3[1], block3[2]};
    nthreads = static_cast<int>(block.x * block.y * block.z);
    // a fresh shared layout per launch
    std::fill(valid.begin(), valid.begin() + std::min(ARENA, arena_cursor + REDZONE), 0);
    shared_vars.clear();
    shared_by_tag.clear();
    dynamic_offset = REDZONE;
    dynamic_bytes = dyn_shared;
    shared_limit = shared_limit_bytes;
    static_shared_bytes = 0;
    if (dynamic_offset + dyn_shared + REDZONE > ARENA) {
        err->kind = LAUNCH;
        snprintf(err->message, sizeof err->message, "%llu bytes of dynamic shared memory is more than the harness holds",
                 dyn_shared);
        return err->kind;
    }
    memset(valid.data() + dynamic_offset, 1, dyn_shared);
    if (dyn_shared) shared_vars.push_back(SharedVar{dynamic_offset, dyn_shared, "extern __shared__ (dynamic)", 0});
    arena_cursor = dynamic_offset + ((dyn_shared + 255) / 256) * 256 + REDZONE;
    // fibers and their stacks (kept between launches; only the first nthreads take part)
    while (fibers.size() < static_cast<size_t>(nthreads)) {
        fibers.emplace_back();
        void* s = mmap(nullptr, STACK + PAGE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        mprotect(s, PAGE, PROT_NONE);  // overflow faults instead of corrupting a neighbour
        fibers.back().stack = static_cast<uint8_t*>(s);
    }
    warp_arrived.assign((nthreads + warp - 1) / warp, 0ull);
    // block order: linear, or a seeded permutation
    const size_t nblocks = size_t(grid.x) * grid.y * grid.z;
    std::vector<size_t> order(nblocks);
    for (size_t i = 0; i < nblocks; ++i) order[i] = i;
    if (seeded)
        for (size_t i = nblocks; i > 1; --i) std::swap(order[i - 1], order[next_random() % i]);
    const bool subset = !only_blocks.empty();
    if (subset) {  // a few blocks of a grid too large to run whole; races across blocks are not judged
        for (size_t b : only_blocks)
            if (b >= nblocks) {
                err->kind = LAUNCH;
                snprintf(err->message, sizeof err->message, "block %zu of a grid of %zu blocks", b, nblocks);
                only_blocks.clear();
                return err->kind;
            }
        order.swap(only_blocks);
        only_blocks.clear();
    }
    in_launch = true;
    aborting = false;
    hit = nullptr;
    launch_first_epoch = epoch + 1;
    check_global_races = !subset && static_cast<double>(nblocks) * nthreads < 2147483647.0;
    for (size_t i = 0; i < order.size() && !aborting; ++i) {
        const size_t b = order[i];
        block_linear = static_cast<long long>(b);
        run_block(uint3_{unsigned(b % grid.x), unsigned((b / grid.x) % grid.y), unsigned(b / (size_t(grid.x) * grid.y))},
                  grid, block);
    }
    in_launch = false;
    cudaemu_vars = nullptr;
    for (Allocation* a : shadowed) std::vector<GlobalShadow>().swap(a->shadow);
    shadowed.clear();
    return err->kind;
}

// The next launch runs only blocks[0..n) (linear block ids), in that order.
void cudaemu_only_blocks(const unsigned long long* blocks, unsigned long long n) {
    only_blocks.assign(blocks, blocks + n);
}

// ---------------------------------------------------------------------------- called by kernels
void cudaemu_syncthreads(int line) {
    if (!current) return;
    Fiber& f = *current;
    f.state = AT_BARRIER;
    f.line = line;
    if (++barrier_arrivals == nthreads) {
        for (int t = 0; t < nthreads; ++t)
            if (const Fiber& g = fibers[t]; g.line != line)
                fail(DEADLOCK, format("threads reach different __syncthreads(): %s on line %d, %s on line %d",
                                      thread_name(f.tid).c_str(), line, thread_name(g.tid).c_str(), g.line));
        void* pc = nullptr;
        const std::string uninitialized = uninitialized_report(&pc);
        if (!uninitialized.empty()) fail(UNINITIALIZED_SHARED, uninitialized, pc);
        barrier_arrivals = 0;
        ++epoch;
        for (int t = 0; t < nthreads; ++t) make_runnable(fibers[t]);
    }
    yield();
}

const unsigned char* cudaemu_fragment_map(int kind, int line) {
    Fiber& f = *current;
    if (warp_size != 32)
        fail(KERNEL_ERROR, format("%s: WMMA on line %d needs a 32-lane warp (this launch runs %d lanes)",
                                  thread_name(f.tid).c_str(), line, warp_size));
    if (kind < 0 || kind >= CUDAEMU_FRAGMENT_KINDS) fail(KERNEL_ERROR, format("fragment kind %d on line %d", kind, line));
    if (!fragment_maps_drawn) {
        uint64_t state = fragment_seed ^ (0x5851f42d4c957f2dull * ++fragment_launches);
        for (int k = 0; k < CUDAEMU_FRAGMENT_KINDS; ++k) {
            unsigned char* m = fragment_maps[k];
            for (int i = 0; i < 256; ++i) m[i] = static_cast<unsigned char>(i);
            do {
                for (int i = 255; i > 0; --i) {
                    uint64_t z = (state += 0x9e3779b97f4a7c15ull);
                    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
                    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
                    std::swap(m[i], m[(z ^ (z >> 31)) % static_cast<uint64_t>(i + 1)]);
                }
            } while (m[0] == 0 && m[1] == 1);  // never the row-major order a careless kernel might assume
        }
        fragment_maps_drawn = true;
    }
    return fragment_maps[kind];
}

void cudaemu_fragment_fail(const char* message, int line) {
    fail(KERNEL_ERROR, format("%s: %s (WMMA call on line %d)", thread_name(current->tid).c_str(), message, line));
}

unsigned long long cudaemu_shfl(int kind, unsigned long long mask, unsigned long long value, int arg, int width, int line) {
    Fiber& f = *current;
    const int lane = f.tid % warp_size, warp = f.tid / warp_size;
    const int lanes_here = std::min(warp_size, nthreads - warp * warp_size);
    const unsigned long long full = warp_size == 64 ? ~0ull : ((1ull << warp_size) - 1);
    if (mask == 0) mask = full;  // HIP's mask-less shuffles: the whole wavefront
    if (width == 0) width = warp_size;
    if (width <= 0 || width > warp_size || (width & (width - 1)))
        fail(KERNEL_ERROR, format("%s: shuffle width %d on line %d is not a power of two <= %d", thread_name(f.tid).c_str(),
                                  width, line, warp_size));
    if (mask & ~full)
        fail(PARTIAL_WARP, format("%s: shuffle mask 0x%llx on line %d names lanes beyond the %d-wide warp",
                                  thread_name(f.tid).c_str(), mask, line, warp_size));
    if (!(mask >> lane & 1ull))
        fail(PARTIAL_WARP, format("%s (lane %d) calls the shuffle on line %d with mask 0x%llx, which leaves it out",
                                  thread_name(f.tid).c_str(), lane, line, mask));
    if (lanes_here < warp_size && (mask >> lanes_here))
        fail(PARTIAL_WARP,
             format("shuffle over a partial warp on line %d: mask 0x%llx names lanes %d-%d of warp %d, which do not exist "
                    "(blockDim has %d threads, not a multiple of the warp size %d)",
                    line, mask, lanes_here, warp_size - 1, warp, nthreads, warp_size));
    const int base = warp * warp_size;
    for (int l = 0; l < lanes_here; ++l) {
        const Fiber& g = fibers[base + l];
        if ((mask >> l & 1ull) && g.state == DONE)
            fail(PARTIAL_WARP, format("%s calls the shuffle on line %d with mask 0x%llx, but lane %d has exited",
                                      thread_name(f.tid).c_str(), line, mask, l));
        if ((warp_arrived[warp] >> l & 1ull) && (g.mask & mask) && (g.mask != mask || g.kind != kind))
            fail(PARTIAL_WARP, format("lanes of warp %d meet at different shuffles: %s on line %d (mask 0x%llx), %s on line "
                                      "%d (mask 0x%llx)",
                                      warp, thread_name(f.tid).c_str(), line, mask, thread_name(g.tid).c_str(), g.line,
                                      g.mask));
    }
    f.state = AT_SHUFFLE;
    f.kind = kind, f.mask = mask, f.value = value, f.arg = arg, f.width = width, f.line = line;
    warp_arrived[warp] |= 1ull << lane;
    if ((warp_arrived[warp] & mask) == mask) {
        for (int l = 0; l < warp_size; ++l) {
            if (!(mask >> l & 1ull)) continue;
            Fiber& g = fibers[base + l];
            const int seg = l & ~(width - 1), in_seg = l - seg;
            int src = l;
            switch (kind) {
                case 0: src = seg + (((g.arg % width) + width) % width); break;
                case 1: src = in_seg >= g.arg ? l - g.arg : l; break;
                case 2: src = in_seg + g.arg < width ? l + g.arg : l; break;
                default: src = (l ^ g.arg); if (src >= seg + width) src = l; break;
            }
            if (src < 0 || src >= warp_size || !(mask >> src & 1ull))
                fail(PARTIAL_WARP, format("%s (lane %d) reads lane %d at the shuffle on line %d, which is not in mask 0x%llx",
                                          thread_name(g.tid).c_str(), l, src, line, mask));
            g.result = fibers[base + src].value;
        }
        warp_arrived[warp] &= ~mask;
        for (int l = 0; l < warp_size; ++l)
            if (mask >> l & 1ull) make_runnable(fibers[base + l]);
    }
    yield();
    return f.result;
}

void* cudaemu_shared_static(const void* tag, unsigned long long size, unsigned long long align, const char* name, int line) {
    auto it = shared_by_tag.find(tag);
    if (it != shared_by_tag.end()) return arena + shared_vars[it->second].offset;
    if (!current) {  // a file-scope __shared__, initialised when the module loads
        unsupported = format("`__shared__ %s` (line %d) is at file scope, which the harness does not emulate", name, line);
        return new char[size]();
    }
    size_t offset = (arena_cursor + align - 1) / align * align;
    if (offset + size + REDZONE > ARENA)
        fail(LAUNCH, format("static shared memory beyond what the harness holds (`%s`, line %d)", name, line));
    static_shared_bytes += size;
    if (static_shared_bytes + dynamic_bytes > shared_limit)
        fail(LAUNCH, format("shared memory per block: %zu bytes static (with `%s`, line %d) + %zu dynamic > the limit of %zu",
                            static_shared_bytes, name, line, dynamic_bytes, shared_limit));
    memset(valid.data() + offset, 1, size);
    memset(arena + offset, 0xff, size);  // poison (first block: the memset in run_block ran before this existed)
    shared_vars.push_back(SharedVar{offset, size, name, line});
    shared_by_tag[tag] = shared_vars.size() - 1;
    arena_cursor = offset + size + REDZONE;
    return arena + offset;
}

void* cudaemu_shared_dynamic(const char*, int) { return arena + dynamic_offset; }

// ---------------------------------------------------------------------------- sanitizer hooks
// GCC's -fsanitize=thread instrumentation calls these before each load/store of the kernel
// module; no TSan runtime is linked.
#define CUDAEMU_HOOK(n)                                                                          \
    void __tsan_read##n(void* p) { access(p, n, false, __builtin_return_address(0)); }           \
    void __tsan_write##n(void* p) { access(p, n, true, __builtin_return_address(0)); }           \
    void __tsan_unaligned_read##n(void* p) { access(p, n, false, __builtin_return_address(0)); } \
    void __tsan_unaligned_write##n(void* p) { access(p, n, true, __builtin_return_address(0)); } \
    void __tsan_volatile_read##n(void* p) { access(p, n, false, __builtin_return_address(0)); }  \
    void __tsan_volatile_write##n(void* p) { access(p, n, true, __builtin_return_address(0)); }
CUDAEMU_HOOK(1)
CUDAEMU_HOOK(2)
CUDAEMU_HOOK(4)
CUDAEMU_HOOK(8)
CUDAEMU_HOOK(16)
void __tsan_read_range(void* p, unsigned long n) {
    for (unsigned long i = 0; i < n; ++i) access(static_cast<char*>(p) + i, 1, false, __builtin_return_address(0));
}
void __tsan_write_range(void* p, unsigned long n) {
    for (unsigned long i = 0; i < n; ++i) access(static_cast<char*>(p) + i, 1, true, __builtin_return_address(0));
}
// GCC's -fsanitize=signed-integer-overflow calls these on a signed overflow (the C++ undefined
// behaviour that 32-bit index arithmetic on large tensors runs into); the data carries the source
// line and the operand type, and values up to 64 bits are passed in the handles themselves.
struct UbsanLocation {
    const char* file;
    uint32_t line, column;
};
struct UbsanType {
    uint16_t kind, info;  // kind 0: integer; info: log2(bit width) << 1 | signed
    char name[1];
};
struct UbsanOverflow {
    UbsanLocation location;
    const UbsanType* type;
};

static long long ubsan_value(const UbsanType* t, uintptr_t handle) {
    const unsigned bits = 1u << (t->info >> 1);
    if (bits >= 64 || !(t->info & 1)) return static_cast<long long>(handle);
    const uint64_t sign = uint64_t(1) << (bits - 1);
    return static_cast<long long>((handle ^ sign) - sign);
}

static void integer_overflow(const UbsanOverflow* d, const char* op, uintptr_t lhs, uintptr_t rhs, void* pc) {
    if (!in_launch || !current || aborting) return;
    const std::string what = op[1] ? format("%s%lld", op, ubsan_value(d->type, lhs))
                                   : format("%lld %s %lld", ubsan_value(d->type, lhs), op, ubsan_value(d->type, rhs));
    fail(INTEGER_OVERFLOW,
         format("%s: signed integer overflow: %s does not fit %s (line %u, column %u)", thread_name(current->tid).c_str(),
                what.c_str(), d->type->name, d->location.line, d->location.column),
         pc);
}

#define CUDAEMU_UBSAN(name, op)                                                                                    \
    void __ubsan_handle_##name(void* d, uintptr_t a, uintptr_t b) {                                               \
        integer_overflow(static_cast<UbsanOverflow*>(d), op, a, b, __builtin_return_address(0));                 \
    }                                                                                                              \
    void __ubsan_handle_##name##_abort(void* d, uintptr_t a, uintptr_t b) {                                       \
        integer_overflow(static_cast<UbsanOverflow*>(d), op, a, b, __builtin_return_address(0));                 \
    }
CUDAEMU_UBSAN(add_overflow, "+")
CUDAEMU_UBSAN(sub_overflow, "-")
CUDAEMU_UBSAN(mul_overflow, "*")
CUDAEMU_UBSAN(divrem_overflow, "/")
void __ubsan_handle_negate_overflow(void* d, uintptr_t a) {
    integer_overflow(static_cast<UbsanOverflow*>(d), "negation of ", a, 0, __builtin_return_address(0));
}
void __ubsan_handle_negate_overflow_abort(void* d, uintptr_t a) {
    integer_overflow(static_cast<UbsanOverflow*>(d), "negation of ", a, 0, __builtin_return_address(0));
}

void __tsan_func_entry(void*) {}
void __tsan_func_exit() {}
void __tsan_init() {}
void __tsan_vptr_update(void**, void*) {}
void __tsan_vptr_read(void**) {}

}  // extern "C"
