// SPDX-License-Identifier: GPL-2.0 OR Apache-2.0
/*
 * Not part of the inspector: the hook designs it could use, reduced to what a
 * process outside every watched cgroup pays, for the benchmark that chooses
 * between them (tests/inspector.rs, tracepoint_mechanism_benchmark). Each
 * program is attached alone:
 *   tp_other      syscalls:sys_enter_getppid, a call the write loop never
 *                 makes: what every syscall pays once any syscall
 *                 tracepoint is on (the slow syscall entry and exit, and the
 *                 perf probe that finds no program for its call)
 *   tp_empty      syscalls:sys_enter_write, returns at once: the least a
 *                 per-syscall tracepoint costs
 *   tp_exit_empty syscalls:sys_exit_write, returns at once (with tp_empty:
 *                 a call hooked at entry and exit)
 *   tp_check      the same, with the inspector's early exit (watched levels,
 *                 one ancestor id, one lookup)
 *   tp_check_ids  the same, with the ancestor id compared with a short list
 *                 of watched ids in global data instead of a hash lookup
 *   raw_empty     raw_syscalls:sys_enter as a raw tracepoint, returns at
 *                 once: the least a dispatcher costs, paid by every syscall
 *   raw_exit_empty raw_syscalls:sys_exit, returns at once
 *   raw_cgroup    raw_syscalls:sys_enter, the cheapest cgroup early exit
 *                 (the task's own cgroup id, one hash lookup) for every call
 *   raw_cgroup_exit the same on raw_syscalls:sys_exit
 *   raw_enter +   one program for every syscall's entry, dispatching on the
 *   raw_exit      syscall id (here: write only) before the early exit, and
 *                 one for every exit that returns unless a record waits
 */
#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_tracing.h>

char LICENSE[] SEC("license") = "Dual BSD/GPL";

#define MAX_CGROUP_LEVEL 16
#define NR_WRITE 1 /* x86_64; the benchmark runs there */

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 1024);
	__type(key, __u64);
	__type(value, __u64);
} watched SEC(".maps");

/* Syscalls the dispatcher handles, by id (the inspector's ~70). */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 512);
	__type(key, __u32);
	__type(value, __u32);
} hooked SEC(".maps");

__u32 watched_levels = 0;
#define WATCHED_IDS 8
__u64 watched_ids[WATCHED_IDS] = {};
__u64 pending_count = 0;
__u64 hits = 0;

static __always_inline __u64 current_watch(void)
{
	__u32 levels = *(volatile __u32 *)&watched_levels;
	for (int level = MAX_CGROUP_LEVEL - 1; level >= 0; level--) {
		if (!(levels & (1U << level)))
			continue;
		__u64 ancestor = bpf_get_current_ancestor_cgroup_id(level);
		if (ancestor && bpf_map_lookup_elem(&watched, &ancestor))
			return ancestor;
	}
	return 0;
}

SEC("tp/syscalls/sys_enter_getppid")
int tp_other(void *ctx)
{
	return 0;
}

SEC("tp/syscalls/sys_enter_write")
int tp_empty(void *ctx)
{
	return 0;
}

SEC("tp/syscalls/sys_exit_write")
int tp_exit_empty(void *ctx)
{
	return 0;
}

SEC("tp/syscalls/sys_enter_write")
int tp_check(void *ctx)
{
	if (current_watch())
		__sync_fetch_and_add(&hits, 1);
	return 0;
}

SEC("tp/syscalls/sys_enter_write")
int tp_check_ids(void *ctx)
{
	__u32 levels = *(volatile __u32 *)&watched_levels;
	for (int level = MAX_CGROUP_LEVEL - 1; level >= 0; level--) {
		if (!(levels & (1U << level)))
			continue;
		__u64 ancestor = bpf_get_current_ancestor_cgroup_id(level);
		for (int i = 0; i < WATCHED_IDS; i++)
			if (ancestor && watched_ids[i] == ancestor)
				__sync_fetch_and_add(&hits, 1);
	}
	return 0;
}

SEC("raw_tp/sys_enter")
int raw_empty(void *ctx)
{
	return 0;
}

SEC("raw_tp/sys_exit")
int raw_exit_empty(void *ctx)
{
	return 0;
}

static __always_inline int own_cgroup_watched(void)
{
	__u64 id = bpf_get_current_cgroup_id();
	if (bpf_map_lookup_elem(&watched, &id))
		__sync_fetch_and_add(&hits, 1);
	return 0;
}

SEC("raw_tp/sys_enter")
int raw_cgroup(void *ctx)
{
	return own_cgroup_watched();
}

SEC("raw_tp/sys_exit")
int raw_cgroup_exit(void *ctx)
{
	return own_cgroup_watched();
}

SEC("raw_tp/sys_enter")
int BPF_PROG(raw_enter, struct pt_regs *regs, long id)
{
	__u32 key = (__u32)id;
	__u32 *hook = bpf_map_lookup_elem(&hooked, &key);
	if (!hook || !*hook)
		return 0;
	if (current_watch())
		__sync_fetch_and_add(&hits, 1);
	return 0;
}

SEC("raw_tp/sys_exit")
int BPF_PROG(raw_exit, struct pt_regs *regs, long ret)
{
	if (!*(volatile __u64 *)&pending_count)
		return 0;
	__sync_fetch_and_add(&hits, 1);
	return 0;
}
