// SPDX-License-Identifier: GPL-2.0 OR Apache-2.0
/*
 * Not part of the inspector: the hook designs it could use, reduced to what a
 * process outside every watched cgroup pays, for the benchmark that chooses
 * between them (tests/inspector.rs, tracepoint_mechanism_benchmark). Each
 * program is attached alone:
 *   tp_empty      syscalls:sys_enter_write, returns at once: the least a
 *                 per-syscall tracepoint costs
 *   tp_check      the same, with the inspector's early exit (watched levels,
 *                 one ancestor id, one lookup)
 *   raw_empty     raw_syscalls:sys_enter as a raw tracepoint, returns at
 *                 once: the least a dispatcher costs, paid by every syscall
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

SEC("tp/syscalls/sys_enter_write")
int tp_empty(void *ctx)
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

SEC("raw_tp/sys_enter")
int raw_empty(void *ctx)
{
	return 0;
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
