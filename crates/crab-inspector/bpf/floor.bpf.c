// SPDX-License-Identifier: GPL-2.0 OR Apache-2.0
/*
 * Not part of the inspector: the least its hooks can cost, for the node
 * benchmark (scripts/bench-inspector-tax, its `floor` phase). src/floor.rs
 * attaches `floor_syscall`, which returns at once, to every tracepoint the
 * inspector's programs use, and each empty tp_btf program below to the
 * scheduler hook of the same name. A process then pays what the kernel's
 * tracepoint mechanism costs on exactly the inspector's hooks (the slow
 * syscall entry and exit, the probe, one program run per hooked call); what
 * it pays with the inspector attached instead, above that, is the
 * inspector's own work.
 */
#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_tracing.h>

char LICENSE[] SEC("license") = "Dual BSD/GPL";

/* Attached by name to each of the inspector's tracepoints; the section only
 * gives the program its type. */
SEC("tp/syscalls/sys_enter_getppid")
int floor_syscall(void *ctx)
{
	return 0;
}

SEC("tp_btf/sched_process_fork")
int BPF_PROG(floor_fork)
{
	return 0;
}

SEC("tp_btf/sched_process_exec")
int BPF_PROG(floor_exec)
{
	return 0;
}

SEC("tp_btf/sched_process_exit")
int BPF_PROG(floor_exit)
{
	return 0;
}
