/*
 * CUDA memory, through the driver API loaded at run time (cuda.c). Nothing CUDA is linked at
 * build time: the first call that needs the driver dlopen()s FERRY_CUDA_LIB, or libcuda.so.1,
 * once per process; without one every pointer is host memory and the fr_cuda_* calls that need
 * a device fail with FERRY_ENOTSUP ("no CUDA driver: ...").
 *
 * Contexts: every call that touches a device makes that device's primary context current on
 * the calling thread first (the one PyTorch and the runtime API use), so any ferry thread may
 * call these. Copies run on a non-blocking stream of the calling thread's own for that device
 * and are complete when the call returns; they do not wait for work on the caller's streams
 * (callers synchronize the stream that wrote the bytes first: docs/GPU.md).
 */
#ifndef FR_CUDA_H
#define FR_CUDA_H

#include "ferry.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define FR_CUDA_MAX_DEVICES 64

/* Where a pointer's bytes live. For CUDA memory, base and size are its allocation's. */
typedef struct fr_mem_where {
  ferry_mem_kind kind;
  int device;     /* CUDA device ordinal; -1 for host memory */
  uintptr_t base; /* CUDA: the allocation's first byte (0 for host memory) */
  size_t size;    /* CUDA: the allocation's bytes */
} fr_mem_where;

/* Loads the driver once (cuInit, devices counted); 0, or FERRY_ENOTSUP with the reason. */
int fr_cuda_load(void);
/* Whether a driver is loaded, without trying to load one. */
bool fr_cuda_loaded(void);

/* Never fails: host memory when no driver loads or the driver does not know the pointer. The
 * first call tries to load the driver (FERRY_CUDA=auto): a device pointer can come from a
 * library that loaded it (torch) before ferry did. One driver call per host pointer after that
 * (~0.3 us on a GPU machine): classify a caller's buffer once per call, never per chunk. */
fr_mem_where fr_cuda_where(const void *ptr);
/* The device ordinal of a caller's buffer, or -1 for host memory. */
static inline int fr_cuda_device_of(const void *ptr) { return fr_cuda_where(ptr).device; }
/* Bytes from p to the end of the CUDA allocation w describes (0 when p lies outside it), or
 * SIZE_MAX for host memory, whose extent ferry cannot know: a copy of n bytes at p stays inside
 * the allocation when n <= this. */
static inline size_t fr_cuda_room(const fr_mem_where *w, const void *p) {
  uintptr_t off = (uintptr_t)p - w->base;
  if (w->kind != FERRY_MEM_CUDA)
    return SIZE_MAX;
  return off <= w->size ? w->size - off : 0;
}
static inline bool fr_cuda_is_device(const void *ptr) {
  return fr_cuda_where(ptr).kind == FERRY_MEM_CUDA;
}

/* n bytes between any two of host and device memory (unified addressing); done on return. */
int fr_cuda_copy(void *dst, const void *src, size_t n);
/* The same, device_hint naming the device whose context runs it (-1: found from the pointers). */
int fr_cuda_copy_on(int device_hint, void *dst, const void *src, size_t n);
/* The same, queued on this thread's stream of `device` without waiting: the bytes are there
 * once fr_cuda_sync(device) returned on this thread, and neither buffer may be touched before
 * (host memory should be pinned, or the driver may copy it synchronously). fr_cuda_sync
 * waits for every copy this thread queued on that device. */
int fr_cuda_copy_async(int device, void *dst, const void *src, size_t n);
int fr_cuda_sync(int device);

/* The process's copy counters (fr_cuda_copy_on: copies, bytes, issue and wait seconds) as
 * ferry_cuda_copy_* samples, none before the first copy (the process set's collector calls it). */
struct fr_stats_out;
void fr_cuda_collect(struct fr_stats_out *out);

/* Pins host memory for the copy engines (cuMemHostRegister, portable), in the context of
 * `device`, the one whose copies it serves; unpin (the same device) undoes it. */
int fr_cuda_pin(int device, void *p, size_t n);
int fr_cuda_unpin(int device, void *p);

/* Device bytes out through host memory: two host buffers of `chunk` bytes (pinned when the driver
 * allows), reused call after call by one thread at a time. fr_cuda_stage_out copies
 * [src, src+n) of `device` chunk by chunk and calls use(arg, buf, len) on each, in order, while
 * the next chunk's copy runs; a non-zero return of `use` stops it and is returned. */
typedef struct fr_cuda_stager fr_cuda_stager;
/* FERRY_CUDA_CHUNK_BYTES, at least a page: how much of a CUDA buffer one staging step moves. */
size_t fr_cuda_chunk_bytes(void);
int fr_cuda_stager_open(size_t chunk, fr_cuda_stager **out);
void fr_cuda_stager_close(fr_cuda_stager *s);
int fr_cuda_stage_out(fr_cuda_stager *s, int device, const void *src, size_t n,
                      int (*use)(void *arg, const void *buf, size_t len), void *arg);
/* fr_cuda_stage_out for memory its owner may free meanwhile (a registered region): each chunk's
 * copy is queued between gate->enter (non-zero: stop, and return that) and gate->leave, with
 * *gate->event (a CUDA event, made at the first copy) recorded after it, so that whoever stops
 * new copies (enter fails) and waits for the copies being queued can wait for the last one
 * queued with fr_cuda_gate_event_finish(device, *event), which also destroys the event. The
 * `use` of a chunk (a send, paced by a peer) runs outside the gate. A NULL gate: as
 * fr_cuda_stage_out. */
typedef struct fr_cuda_gate {
  int (*enter)(void *arg);
  void (*leave)(void *arg);
  void *arg;
  void **event;
} fr_cuda_gate;
int fr_cuda_stage_out_gated(fr_cuda_stager *s, int device, const void *src, size_t n,
                            const fr_cuda_gate *gate,
                            int (*use)(void *arg, const void *buf, size_t len), void *arg);
/* Waits for the copy last recorded in a gate's event until deadline_ns (fr_now_ns), then destroys
 * the event: 0. FERRY_ETIMEDOUT when the copy still runs then: the event is kept (the copy may
 * still read the memory), and so must the memory be. */
int fr_cuda_gate_event_finish(int device, void *event, uint64_t deadline_ns);
/* The other way: host bytes into [dst, dst+n) of `device`, chunk by chunk: fill(arg, buf, len)
 * writes each chunk into a staging buffer, in order, and its host → device copy runs while the
 * next chunk is filled into the other buffer; a non-zero return of `fill` stops it and is
 * returned. Returns once every copy finished. */
int fr_cuda_stage_in(fr_cuda_stager *s, int device, void *dst, size_t n,
                     int (*fill)(void *arg, void *buf, size_t len), void *arg);
/* Takes this thread's stager of FERRY_CUDA_CHUNK_BYTES chunks (as the setting was at its first
 * use): made, and its buffers pinned, the first time the thread stages; closed when the thread
 * exits. One staging at a time per thread: FERRY_EBUSY (no detail set) while the thread holds it
 * already (a staging inside a staging). fr_cuda_thread_stager_give hands it back. */
int fr_cuda_thread_stager_take(fr_cuda_stager **out);
void fr_cuda_thread_stager_give(void);

int fr_cuda_alloc(int device, size_t n, void **out);
int fr_cuda_free(void *p);

/* A CUDA IPC handle of the allocation that holds a pointer, as peers receive it (wire format:
 * little-endian, fixed layout). The importer maps the whole allocation and adds offset. */
typedef struct fr_cuda_ipc {
  uint8_t handle[64];
  uint64_t offset;      /* of the exported pointer within its allocation */
  uint64_t alloc_bytes; /* the allocation's size */
  int32_t device;       /* the exporter's device ordinal */
  uint32_t reserved;
} fr_cuda_ipc;
_Static_assert(sizeof(fr_cuda_ipc) == 88, "fr_cuda_ipc is part of the protocol");

int fr_cuda_ipc_export(const void *ptr, fr_cuda_ipc *out);
/* Maps an exported allocation in this process, in `device`'s context (-1: the exporter's ordinal
 * when this process has it, else 0; ordinals differ between processes under
 * CUDA_VISIBLE_DEVICES); *base is the allocation's first byte here, checked to be at least
 * h->alloc_bytes long. Close with fr_cuda_ipc_close(base). A process cannot open its own
 * handles (the driver refuses). */
int fr_cuda_ipc_open(const fr_cuda_ipc *h, int device, void **base);
int fr_cuda_ipc_close(void *base);

#endif
