// SPDX-License-Identifier: GPL-2.0 OR Apache-2.0
/*
 * Crab inspector: records what processes in watched cgroup v2 groups do to
 * the OS (file changes, processes, sockets, mounts).
 *
 * Only tracepoints are used because kprobes, fentry and lsm programs are not
 * available on every host crab runs on. Each syscall the inspector needs has
 * its own thin program on its syscalls:sys_enter_<name> tracepoint (and
 * sys_exit_<name> when the record waits for the result), all calling the
 * same shared handlers below: syscalls nobody needs (read, stat, getdents,
 * futex, ...) run no BPF at all.
 *
 * What processes outside watched cgroups pay while the programs are attached
 * is almost all the kernel's: with any syscall tracepoint enabled every task
 * takes the slow syscall entry and exit. Measured (tests/inspector.rs,
 * tracepoint_mechanism_benchmark: bpf/mechanism.bpf.c), an empty program on
 * sys_enter_write costs a 512-byte write loop as much as one with the early
 * exit below, and one raw_tp dispatcher on sys_enter/sys_exit about the same
 * again: neither the program's body nor the hook design moves that floor,
 * only not being attached does. So the reader attaches the programs only
 * while something is watched (src/lib.rs).
 *
 * Syscall arguments are captured at sys_enter (paths are resolved there,
 * before e.g. an unlink removes the dentry) and kept per thread; sys_exit
 * publishes the record only when the call succeeded, so failed calls cost no
 * ring buffer space.
 */
#include "vmlinux.h"
#include <bpf/bpf_core_read.h>
#include <bpf/bpf_endian.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_tracing.h>
#include "inspector.h"

char LICENSE[] SEC("license") = "Dual BSD/GPL";

#define AT_FDCWD -100
#define AF_UNIX 1
#define AF_INET 2
#define AF_INET6 10
#define EINPROGRESS 115
#define O_WRONLY 01
#define O_RDWR 02
#define O_CREAT 0100
#define O_TRUNC 01000
#define WRITE_OPEN_FLAGS (O_WRONLY | O_RDWR | O_CREAT | O_TRUNC)
#define FMODE_WRITE 0x2
#define S_IFMT 00170000
#define S_IFREG 0100000
#define MAP_TYPE 0x0f
#define MAP_SHARED 0x01
#define MAP_SHARED_VALIDATE 0x03
#define VM_WRITE 0x2
#define VM_SHARED 0x8
/* Error pointers (MNT_NS_INTERNAL is ERR_PTR(-EINVAL)) are the top 4095 addresses. */
#define MAX_ERRNO 4095
#define IORING_SETUP_SQPOLL (1U << 1)

extern void *bpf_rdonly_cast(const void *obj, __u32 btf_id) __ksym;

/* Scratch slots: syscall programs and sched programs never share one, so a
 * sched tracepoint firing inside a syscall cannot clobber a half-built record. */
#define SCRATCH_SYSCALL 0
#define SCRATCH_SCHED 1

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 1024);
	__type(key, __u64); /* cgroup v2 id */
	__type(value, struct watch);
} watched SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, 16 * 1024 * 1024);
} events SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 1024);
	__type(key, __u64);   /* cgroup v2 id */
	__type(value, __u64); /* records dropped */
} lost SEC(".maps");

/* The latest write of each (process, file): see struct write_seen. LRU: an
 * evicted key only costs one more record. The reader deletes the keys of a
 * container's earlier turns at each drain. */
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 8192);
	__type(key, struct write_key);
	__type(value, struct write_seen);
} written SEC(".maps");

/* Records waiting for their syscall's exit, by thread id. Not preallocated:
 * a record is 12 KiB and only threads inside a recorded call (possibly a
 * long blocking connect) hold one; when the map is full the record is
 * counted lost. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 8192);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, __u32);
	__type(value, struct record);
} pending SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 2);
	__type(key, __u32);
	__type(value, struct record);
} scratch SEC(".maps");

/* Never read or written: a global of each layout the Rust side decodes makes the skeleton
 * generate their Rust types, against which crab-inspector checks its offsets at compile
 * time (src/layout.rs). */
struct crab_layouts {
	struct record_header record_header;
	struct path_ref path_ref;
	struct write_key write_key;
	struct write_seen write_seen;
} crab_layouts = {};

/* Records in `pending`. Almost always 0, which lets the sys_exit program,
 * run for every syscall of every task, return without a hash lookup. */
__u64 pending_count = 0;

static __always_inline void count_lost(__u64 cgroup_id)
{
	__u64 one = 1;
	__u64 *n = bpf_map_lookup_elem(&lost, &cgroup_id);
	if (n)
		__sync_fetch_and_add(n, 1);
	else if (bpf_map_update_elem(&lost, &cgroup_id, &one, BPF_NOEXIST))
		/* Another CPU created the entry first. */
		if ((n = bpf_map_lookup_elem(&lost, &cgroup_id)))
			__sync_fetch_and_add(n, 1);
}

/* Which cgroups are watched, for the early exit (see struct watch_filter).
 * In a section of its own, which the reader rewrites whole. */
struct watch_filter watch_filter SEC(".data.levels") = {};

/* Whether `id` is one of the first `nr` watched ids of the filter. */
static __always_inline bool listed(__u64 id, __u32 nr)
{
	for (int i = 0; i < WATCHED_IDS; i++) {
		if (i >= nr)
			return false;
		if (*(volatile __u64 *)&watch_filter.ids[i] == id)
			return true;
	}
	return false;
}

/* The watched cgroup the current task is in or below (0 when none), and its
 * `watched` entry.
 *
 * This runs first in every program, for every task on the node that makes
 * one of the recorded calls: its cost is what processes outside watched
 * cgroups pay. A task is in or below watched cgroup C at level L exactly when
 * its ancestor at level L is C, so only the levels that hold a watched cgroup
 * are looked at (usually one: every sandbox at the same depth), one helper
 * call each, deepest first; the ancestor is compared with the few watched ids
 * before the hash lookup, which only a watched task (or one among more than
 * WATCHED_IDS watched cgroups) then pays. A stale list only costs a lookup
 * that fails: `watched` decides. */
static __always_inline __u64 current_watch(struct watch **watch)
{
	__u32 levels = *(volatile __u32 *)&watch_filter.levels;
	__u32 nr = *(volatile __u32 *)&watch_filter.nr_ids;
	if (levels & LEVELS_UNKNOWN) {
		/* Every level from the task's own up. */
		__u64 id = bpf_get_current_cgroup_id();
		if ((*watch = bpf_map_lookup_elem(&watched, &id)))
			return id;
		for (int level = 1; level < MAX_CGROUP_LEVEL; level++) {
			__u64 ancestor = bpf_get_current_ancestor_cgroup_id(level);
			if (!ancestor || ancestor == id)
				break;
			if ((*watch = bpf_map_lookup_elem(&watched, &ancestor)))
				return ancestor;
		}
		return 0;
	}
	for (int level = MAX_CGROUP_LEVEL - 1; level >= 0; level--) {
		if (!(levels & (1U << level)))
			continue;
		/* 0: the task's own cgroup is above this level. */
		__u64 ancestor = bpf_get_current_ancestor_cgroup_id(level);
		if (!ancestor || (nr <= WATCHED_IDS && !listed(ancestor, nr)))
			continue;
		if ((*watch = bpf_map_lookup_elem(&watched, &ancestor)))
			return ancestor;
	}
	*watch = NULL;
	return 0;
}

static __always_inline __u64 current_watched_cgroup(void)
{
	struct watch *watch;
	return current_watch(&watch);
}

/* A cleared scratch record for the current task of watched cgroup `cgroup_id`. */
static __always_inline struct record *begin_in(__u64 cgroup_id, __u32 kind, __u32 slot)
{
	struct record *r = bpf_map_lookup_elem(&scratch, &slot);
	if (!r)
		return NULL;
	__builtin_memset(&r->h, 0, sizeof(r->h));
	r->retry_str[0] = 0;
	r->retry_str[1] = 0;
	__u64 pid_tgid = bpf_get_current_pid_tgid();
	r->h.kind = kind;
	r->h.pid = pid_tgid >> 32;
	r->h.tid = (__u32)pid_tgid;
	r->h.cgroup_id = cgroup_id;
	bpf_get_current_comm(r->h.comm, sizeof(r->h.comm));
	return r;
}

/* A cleared scratch record for the current task, or NULL when it is not watched. */
static __always_inline struct record *begin(__u32 kind, __u32 slot)
{
	__u64 cgroup_id = current_watched_cgroup();
	if (!cgroup_id)
		return NULL;
	return begin_in(cgroup_id, kind, slot);
}

/* --- path resolution ------------------------------------------------------ */

struct walk_state {
	struct dentry *dentry;
	struct mount *mnt;
	struct dentry *root_dentry;
	struct vfsmount *root_mnt;
	__u32 slot;
	__u32 off;
	__u32 flags; /* PATH_* outcome, 0 while walking */
	bool done;
};

/* One step up the tree: emit the current dentry's name, or cross to the
 * parent mount when at a mount's root. Returns 1 to stop the loop. */
static long walk_step(__u32 i, struct walk_state *w)
{
	/* Plain locals: BPF_CORE_READ must see kernel types, not walk_state. */
	struct dentry *dentry = w->dentry;
	struct mount *mnt = w->mnt;
	struct vfsmount *vfsmnt = &mnt->mnt;
	if (dentry == w->root_dentry && vfsmnt == w->root_mnt) {
		w->done = true;
		return 1;
	}
	struct dentry *mnt_root = BPF_CORE_READ(vfsmnt, mnt_root);
	struct dentry *parent = BPF_CORE_READ(dentry, d_parent);
	if (dentry == mnt_root || dentry == parent) {
		struct mount *up = BPF_CORE_READ(mnt, mnt_parent);
		if (up == mnt || dentry != mnt_root) {
			w->flags |= PATH_OUTSIDE_ROOT;
			return 1;
		}
		w->dentry = BPF_CORE_READ(mnt, mnt_mountpoint);
		w->mnt = up;
		return 0;
	}
	struct record *r = bpf_map_lookup_elem(&scratch, &w->slot);
	if (!r)
		return 1;
	if (w->off >= DATA_CAP) {
		w->flags |= PATH_TRUNCATED;
		return 1;
	}
	__u32 off = w->off & (DATA_CAP - 1);
	const unsigned char *name = BPF_CORE_READ(dentry, d_name.name);
	long n = bpf_probe_read_kernel_str(&r->data[off], NAME_READ, name);
	if (n <= 0) {
		w->flags |= PATH_UNRESOLVED;
		return 1;
	}
	w->off = off + n;
	w->dentry = parent;
	return 0;
}

/* Writes the components of `p` (a kernel struct path) from the leaf up to the
 * current task's root into the scratch record; fills the base half of `ref`. */
static __always_inline __u32 walk_path(struct path_ref *ref, __u32 slot, __u32 off,
				       struct dentry *dentry, struct vfsmount *vfsmnt)
{
	struct task_struct *task = (struct task_struct *)bpf_get_current_task();
	struct walk_state w = {
		.dentry = dentry,
		.mnt = container_of(vfsmnt, struct mount, mnt),
		.root_dentry = BPF_CORE_READ(task, fs, root.dentry),
		.root_mnt = BPF_CORE_READ(task, fs, root.mnt),
		.slot = slot,
		.off = off,
	};
	if (!dentry || !vfsmnt) {
		ref->flags |= PATH_UNRESOLVED;
		return off;
	}
	bpf_loop(MAX_DEPTH, walk_step, &w, 0);
	if (!w.done)
		ref->flags |= w.flags ? w.flags : PATH_UNRESOLVED;
	ref->base_off = off;
	ref->base_len = w.off - off;
	return w.off;
}

/* The open file behind descriptor `fd` of the current task, or NULL. The
 * task's own fields are read directly (BTF pointer loads); only the slot of
 * the descriptor array, which BTF types as a plain pointer, takes a copy. */
static __always_inline struct file *fd_file(int fd)
{
	struct task_struct *task = bpf_get_current_task_btf();
	struct fdtable *fdt = task->files->fdt;
	if (fd < 0 || (unsigned int)fd >= fdt->max_fds)
		return NULL;
	struct file *file = NULL;
	bpf_probe_read_kernel(&file, sizeof(file), &fdt->fd[fd]);
	return file;
}

static __always_inline __u32 walk_fd(struct path_ref *ref, __u32 slot, __u32 off, int fd)
{
	struct file *file = fd_file(fd);
	if (!file) {
		ref->flags |= PATH_UNRESOLVED;
		return off;
	}
	return walk_path(ref, slot, off, BPF_CORE_READ(file, f_path.dentry),
			 BPF_CORE_READ(file, f_path.mnt));
}

static __always_inline __u32 walk_cwd(struct path_ref *ref, __u32 slot, __u32 off)
{
	struct task_struct *task = (struct task_struct *)bpf_get_current_task();
	return walk_path(ref, slot, off, BPF_CORE_READ(task, fs, pwd.dentry),
			 BPF_CORE_READ(task, fs, pwd.mnt));
}

/* Copies a string (user or kernel memory) into the data area as `ref`'s user part. */
static __always_inline __u32 copy_string(struct record *r, struct path_ref *ref, __u32 off,
					 const char *s, bool kernel)
{
	ref->flags |= PATH_PRESENT;
	if (off >= DATA_CAP) {
		ref->flags |= PATH_TRUNCATED;
		return off;
	}
	off &= DATA_CAP - 1;
	long n = kernel ? bpf_probe_read_kernel_str(&r->data[off], USER_MAX, s)
			: bpf_probe_read_user_str(&r->data[off], USER_MAX, s);
	if (n <= 0) {
		ref->flags |= PATH_FAULT;
		return off;
	}
	if (n == USER_MAX)
		ref->flags |= PATH_TRUNCATED;
	ref->user_off = off;
	ref->user_len = n;
	return off + n;
}

/* Copies path i's user string; when its page is not paged in yet, keeps the
 * address so that sys_exit can read it again. */
static __always_inline __u32 copy_user_string(struct record *r, int i, __u32 off, const char *user)
{
	struct path_ref *ref = &r->h.path[i & 1];
	off = copy_string(r, ref, off, user, false);
	if (ref->flags & PATH_FAULT)
		r->retry_str[i & 1] = (__u64)user;
	return off;
}

/* A path argument of an *at() call: the string, plus the directory it is
 * relative to when it is not absolute (dfd, or the cwd for AT_FDCWD). A NULL
 * or empty string names the file `dfd` itself (AT_EMPTY_PATH, utimensat).
 * An unreadable string may still turn out relative when sys_exit reads it
 * again, so its base is walked now, while it is sure to exist. */
static __always_inline __u32 capture_at(struct record *r, int i, __u32 slot, __u32 off,
					long dfd, const char *user)
{
	struct path_ref *ref = &r->h.path[i & 1];
	ref->flags |= PATH_PRESENT;
	__u32 start = off & (DATA_CAP - 1);
	if (user) {
		off = copy_user_string(r, i, off, user);
		if (ref->flags & PATH_TRUNCATED)
			return off;
		if (!(ref->flags & PATH_FAULT) && r->data[start] == '/')
			return off;
	}
	if ((int)dfd == AT_FDCWD)
		return walk_cwd(ref, slot, off);
	return walk_fd(ref, slot, off, (int)dfd);
}

static __always_inline __u32 capture_fd(struct record *r, int i, __u32 slot, __u32 off, long fd)
{
	struct path_ref *ref = &r->h.path[i & 1];
	ref->flags |= PATH_PRESENT;
	return walk_fd(ref, slot, off, (int)fd);
}

static __always_inline __u32 capture_verbatim(struct record *r, int i, __u32 off, const char *user)
{
	struct path_ref *ref = &r->h.path[i & 1];
	ref->flags |= PATH_VERBATIM;
	if (!user)
		return off;
	return copy_user_string(r, i, off, user);
}

/* --- syscall enter / exit ----------------------------------------------- */

/* Keeps the record until the syscall returns. */
static __always_inline int stash(struct record *r, __u32 off)
{
	r->h.data_len = off;
	__u32 tid = r->h.tid;
	if (!bpf_map_update_elem(&pending, &tid, r, BPF_NOEXIST))
		__sync_fetch_and_add(&pending_count, 1);
	/* A stale record of this thread (its call never returned): replace it. */
	else if (bpf_map_update_elem(&pending, &tid, r, BPF_EXIST))
		count_lost(r->h.cgroup_id);
	return 0;
}

static __always_inline bool succeeded(__u32 kind, long ret)
{
	if (kind == KIND_CONNECT)
		return ret == 0 || ret == -EINPROGRESS;
	return ret >= 0;
}

/* Returns 0 when the record is on the ring buffer. */
static __always_inline int publish(struct record *r)
{
	__u32 len = r->h.data_len;
	if (len > DATA_BUF)
		len = DATA_BUF;
	/* Waking the reader per record costs more than building the record (an
	 * IPI, a VM exit under virtualization): the reader polls on a short
	 * timer instead, and is woken only when the buffer fills up. */
	__u64 avail = bpf_ringbuf_query(&events, BPF_RB_AVAIL_DATA);
	__u64 size = bpf_ringbuf_query(&events, BPF_RB_RING_SIZE);
	__u64 flags = avail >= size / 4 ? BPF_RB_FORCE_WAKEUP : BPF_RB_NO_WAKEUP;
	if (bpf_ringbuf_output(&events, r, sizeof(r->h) + len, flags)) {
		count_lost(r->h.cgroup_id);
		return -1;
	}
	return 0;
}

static __always_inline void forget_pending(__u32 tid)
{
	if (!bpf_map_delete_elem(&pending, &tid))
		__sync_fetch_and_add(&pending_count, -1);
}

/* Reads the user strings that were not paged in at sys_enter again, now that
 * the call has succeeded (and so has faulted them in), appending them to the
 * data area. The base walked at sys_enter stays; the decoder ignores it when
 * the string is absolute. */
static __always_inline void retry_faulted_strings(struct record *r)
{
	__u32 off = r->h.data_len;
	for (int i = 0; i < 2; i++) {
		const char *user = (const char *)r->retry_str[i];
		struct path_ref *ref = &r->h.path[i];
		if (!user || !(ref->flags & PATH_FAULT))
			continue;
		if (off >= DATA_CAP) {
			ref->flags |= PATH_TRUNCATED;
			continue;
		}
		off &= DATA_CAP - 1;
		long n = bpf_probe_read_user_str(&r->data[off], USER_MAX, user);
		if (n <= 0)
			continue;
		ref->flags &= ~PATH_FAULT;
		if (n == USER_MAX)
			ref->flags |= PATH_TRUNCATED;
		ref->user_off = off;
		ref->user_len = n;
		off += n;
	}
	r->h.data_len = off;
}

static __always_inline void note_written(__u64 cgroup_id, struct inode *inode, bool mapping, __u64 now);
static __always_inline bool is_named_regular_file(struct file *file);

/* An open for writing is the record of the writes through its descriptor in
 * this turn: it names the file (arg2: the inode, the dedup key) and keeps
 * them from being recorded again. */
static __always_inline void opened_for_write(struct record *r, long fd)
{
	struct file *file = fd_file((int)fd);
	if (!file || !(BPF_CORE_READ(file, f_mode) & FMODE_WRITE) || !is_named_regular_file(file))
		return;
	r->h.arg[2] = (__u64)BPF_CORE_READ(file, f_inode);
}

static __always_inline int finish(long ret)
{
	if (!*(volatile __u64 *)&pending_count)
		return 0;
	__u32 tid = (__u32)bpf_get_current_pid_tgid();
	struct record *r = bpf_map_lookup_elem(&pending, &tid);
	if (!r)
		return 0;
	if (succeeded(r->h.kind, ret)) {
		r->h.ret = ret;
		if (r->retry_str[0] | r->retry_str[1])
			retry_faulted_strings(r);
		r->h.ts_ns = bpf_ktime_get_ns();
		if (r->h.kind == KIND_OPEN)
			opened_for_write(r, ret);
		if (!publish(r) && r->h.kind == KIND_OPEN && r->h.arg[2])
			note_written(r->h.cgroup_id, (struct inode *)r->h.arg[2], false, r->h.ts_ns);
	}
	forget_pending(tid);
	return 0;
}

/*
 * A syscall's program on its own syscalls:sys_enter_<call> tracepoint. The
 * body maps the call's arguments (ARG(n)) onto the shared handlers; with
 * everything inlined, each program is compiled for its one call.
 */
#define ENTER(call) \
	static __always_inline int handle_##call(struct trace_event_raw_sys_enter *ctx); \
	SEC("tp/syscalls/sys_enter_" #call) int enter_##call(struct trace_event_raw_sys_enter *ctx) \
	{ \
		return handle_##call(ctx); \
	} \
	static __always_inline int handle_##call(struct trace_event_raw_sys_enter *ctx)

/* Calls whose record waits for their result (see stash) also get a program
 * on sys_exit_<call>, which publishes it. */
#define ENTER_EXIT(call) \
	SEC("tp/syscalls/sys_exit_" #call) int exit_##call(struct trace_event_raw_sys_exit *ctx) \
	{ \
		return finish(ctx->ret); \
	} \
	ENTER(call)

#define ARG(n) (ctx->args[n])
#define STR(n) ((const char *)ARG(n))

/* Opens a record for the current task or returns from the program. */
#define BEGIN(r, kind) \
	struct record *r = begin(kind, SCRATCH_SYSCALL); \
	if (!r) \
		return 0; \
	__u32 off = 0

/* Calls whose single path argument is `dfd`-relative, with two plain arguments kept. */
#define AT_CALL(call, kind, dfd, path, a0, a1) \
	ENTER_EXIT(call) \
	{ \
		BEGIN(r, kind); \
		r->h.arg[0] = a0; \
		r->h.arg[1] = a1; \
		off = capture_at(r, 0, SCRATCH_SYSCALL, off, dfd, path); \
		return stash(r, off); \
	} \

/* Calls on an open file descriptor. */
#define FD_CALL(call, kind, fd, a0, a1) \
	ENTER_EXIT(call) \
	{ \
		BEGIN(r, kind); \
		r->h.arg[0] = a0; \
		r->h.arg[1] = a1; \
		off = capture_fd(r, 0, SCRATCH_SYSCALL, off, fd); \
		return stash(r, off); \
	} \

static __always_inline bool opens_for_write(__u64 flags)
{
	return flags & WRITE_OPEN_FLAGS;
}

static __always_inline int open_common(long dfd,
				       const char *path, __u64 flags, __u64 mode)
{
	if (!opens_for_write(flags))
		return 0;
	BEGIN(r, KIND_OPEN);
	r->h.arg[0] = flags;
	r->h.arg[1] = mode;
	off = capture_at(r, 0, SCRATCH_SYSCALL, off, dfd, path);
	return stash(r, off);
}

ENTER_EXIT(open) { return open_common(AT_FDCWD, STR(0), ARG(1), ARG(2)); }
ENTER_EXIT(openat) { return open_common(ARG(0), STR(1), ARG(2), ARG(3)); }
ENTER_EXIT(creat) { return open_common(AT_FDCWD, STR(0), O_CREAT | O_WRONLY | O_TRUNC, ARG(1)); }
ENTER_EXIT(openat2)
{
	__u64 flags = 0;
	struct open_how *how = (struct open_how *)ARG(2);
	if (bpf_probe_read_user(&flags, sizeof(flags), &how->flags))
		flags = O_RDWR; /* unreadable: assume the worst */
	__u64 mode = 0;
	bpf_probe_read_user(&mode, sizeof(mode), &how->mode);
	return open_common(ARG(0), STR(1), flags, mode);
}

AT_CALL(truncate, KIND_TRUNCATE, AT_FDCWD, STR(0), ARG(1), 0)
AT_CALL(unlink, KIND_UNLINK, AT_FDCWD, STR(0), 0, 0)
AT_CALL(unlinkat, KIND_UNLINK, ARG(0), STR(1), ARG(2), 0)
AT_CALL(rmdir, KIND_RMDIR, AT_FDCWD, STR(0), 0, 0)
AT_CALL(mkdir, KIND_MKDIR, AT_FDCWD, STR(0), ARG(1), 0)
AT_CALL(mkdirat, KIND_MKDIR, ARG(0), STR(1), ARG(2), 0)
AT_CALL(chmod, KIND_CHMOD, AT_FDCWD, STR(0), ARG(1), 0)
AT_CALL(fchmodat, KIND_CHMOD, ARG(0), STR(1), ARG(2), 0)
AT_CALL(fchmodat2, KIND_CHMOD, ARG(0), STR(1), ARG(2), ARG(3))
FD_CALL(fchmod, KIND_CHMOD, ARG(0), ARG(1), 0)
AT_CALL(chown, KIND_CHOWN, AT_FDCWD, STR(0), ARG(1), ARG(2))
AT_CALL(lchown, KIND_CHOWN, AT_FDCWD, STR(0), ARG(1), ARG(2))
AT_CALL(fchownat, KIND_CHOWN, ARG(0), STR(1), ARG(2), ARG(3))
FD_CALL(fchown, KIND_CHOWN, ARG(0), ARG(1), ARG(2))
AT_CALL(mknod, KIND_MKNOD, AT_FDCWD, STR(0), ARG(1), ARG(2))
AT_CALL(mknodat, KIND_MKNOD, ARG(0), STR(1), ARG(2), ARG(3))
AT_CALL(utimes, KIND_UTIMES, AT_FDCWD, STR(0), 0, 0)
AT_CALL(utime, KIND_UTIMES, AT_FDCWD, STR(0), 0, 0)
AT_CALL(futimesat, KIND_UTIMES, ARG(0), STR(1), 0, 0)
AT_CALL(utimensat, KIND_UTIMES, ARG(0), STR(1), ARG(3), 0)

/* Two-path calls: path0 is the name the call creates or changes. */
#define TWO_PATH_CALL(call, kind, dfd0, path0, dfd1, path1, a0) \
	ENTER_EXIT(call) \
	{ \
		BEGIN(r, kind); \
		r->h.arg[0] = a0; \
		off = capture_at(r, 0, SCRATCH_SYSCALL, off, dfd0, path0); \
		off = capture_at(r, 1, SCRATCH_SYSCALL, off, dfd1, path1); \
		return stash(r, off); \
	} \

TWO_PATH_CALL(rename, KIND_RENAME, AT_FDCWD, STR(0), AT_FDCWD, STR(1), 0)
TWO_PATH_CALL(renameat, KIND_RENAME, ARG(0), STR(1), ARG(2), STR(3), 0)
TWO_PATH_CALL(renameat2, KIND_RENAME, ARG(0), STR(1), ARG(2), STR(3), ARG(4))
TWO_PATH_CALL(link, KIND_LINK, AT_FDCWD, STR(1), AT_FDCWD, STR(0), 0)
TWO_PATH_CALL(linkat, KIND_LINK, ARG(2), STR(3), ARG(0), STR(1), ARG(4))
TWO_PATH_CALL(move_mount, KIND_MOVE_MOUNT, ARG(2), STR(3), ARG(0), STR(1), ARG(4))

ENTER_EXIT(symlink)
{
	BEGIN(r, KIND_SYMLINK);
	off = capture_at(r, 0, SCRATCH_SYSCALL, off, AT_FDCWD, STR(1));
	off = capture_verbatim(r, 1, off, STR(0));
	return stash(r, off);
}
ENTER_EXIT(symlinkat)
{
	BEGIN(r, KIND_SYMLINK);
	off = capture_at(r, 0, SCRATCH_SYSCALL, off, ARG(1), STR(2));
	off = capture_verbatim(r, 1, off, STR(0));
	return stash(r, off);
}

/* xattr calls keep the attribute name in `extra`. */
#define XATTR_CALL(call, kind, capture, name) \
	ENTER_EXIT(call) \
	{ \
		BEGIN(r, kind); \
		bpf_probe_read_user_str(r->h.extra, sizeof(r->h.extra), name); \
		off = capture; \
		return stash(r, off); \
	} \

XATTR_CALL(setxattr, KIND_SETXATTR, capture_at(r, 0, SCRATCH_SYSCALL, off, AT_FDCWD, STR(0)), STR(1))
XATTR_CALL(lsetxattr, KIND_SETXATTR, capture_at(r, 0, SCRATCH_SYSCALL, off, AT_FDCWD, STR(0)), STR(1))
XATTR_CALL(fsetxattr, KIND_SETXATTR, capture_fd(r, 0, SCRATCH_SYSCALL, off, ARG(0)), STR(1))
XATTR_CALL(setxattrat, KIND_SETXATTR, capture_at(r, 0, SCRATCH_SYSCALL, off, ARG(0), STR(1)), STR(3))
XATTR_CALL(removexattr, KIND_REMOVEXATTR, capture_at(r, 0, SCRATCH_SYSCALL, off, AT_FDCWD, STR(0)), STR(1))
XATTR_CALL(lremovexattr, KIND_REMOVEXATTR, capture_at(r, 0, SCRATCH_SYSCALL, off, AT_FDCWD, STR(0)), STR(1))
XATTR_CALL(fremovexattr, KIND_REMOVEXATTR, capture_fd(r, 0, SCRATCH_SYSCALL, off, ARG(0)), STR(1))
XATTR_CALL(removexattrat, KIND_REMOVEXATTR, capture_at(r, 0, SCRATCH_SYSCALL, off, ARG(0), STR(1)), STR(3))

/* --- writes through descriptors and shared mappings ---------------------- */

/*
 * A process that opened a file in an earlier turn (a daemon's log) changes it
 * with no open in this turn: every write-like call on a descriptor is looked
 * at. Only regular files that can be found by path count: pipes, sockets,
 * ttys, anon inodes (eventfd, ...) are not regular; memfd files are, but live
 * on a kernel-internal mount that no mount namespace holds.
 *
 * Recorded at sys_enter without waiting for the result: a write that then
 * fails is reported anyway (over, never under), and the hot path stays free
 * of the per-thread pending record.
 */
static __always_inline bool is_named_regular_file(struct file *file)
{
	umode_t mode = BPF_CORE_READ(file, f_inode, i_mode);
	if ((mode & S_IFMT) != S_IFREG)
		return false;
	struct mount *mnt = container_of(BPF_CORE_READ(file, f_path.mnt), struct mount, mnt);
	unsigned long ns = (unsigned long)BPF_CORE_READ(mnt, mnt_ns);
	return ns && ns < (unsigned long)-MAX_ERRNO;
}

/* Start time (CLOCK_MONOTONIC) of the current process: with the pid, it
 * names the process even when the pid is used again. */
static __always_inline __u64 current_start_ns(void)
{
	struct task_struct *task = bpf_get_current_task_btf();
	return task->group_leader->start_time;
}

/*
 * True when `key` was recorded in this turn already, by this very process.
 * The repeat is then noted for the reader, which must find the repeats that
 * came after the turn's cut but before the drain that moved the boundary
 * (see drain), and carry them into the next turn.
 *
 * Taking the time is most of the cost of a repeat, so a process started in
 * this turn does not: it only marks the key `untimed`. Such a process
 * usually exits before the turn ends, and then none of its writes can be
 * after the cut; the reader carries the write over when it cannot tell (no
 * exit by the cut, or the exit record lost). A process from an earlier turn
 * (a daemon, a shell session) stores the time of each repeat.
 */
static __always_inline bool recorded_this_turn(struct write_key *key, __u64 cgroup_id,
					       struct watch *watch, __u64 start_ns)
{
	struct write_seen *seen = bpf_map_lookup_elem(&written, key);
	if (!seen || seen->cgroup_id != cgroup_id || seen->recorded_ns <= watch->epoch_ns ||
	    seen->start_ns != start_ns)
		return false;
	if (start_ns > watch->epoch_ns) {
		if (!seen->untimed)
			seen->untimed = 1;
	} else {
		seen->last_ns = bpf_ktime_get_ns();
	}
	return true;
}

/* Marks `key` as recorded in this turn at `now` by the current process. */
static __always_inline void note_recorded(struct write_key *key, __u64 cgroup_id, __u64 now)
{
	struct write_seen fresh = {
		.recorded_ns = now,
		.last_ns = now,
		.cgroup_id = cgroup_id,
		.start_ns = current_start_ns(),
	};
	bpf_map_update_elem(&written, key, &fresh, BPF_ANY);
}

static __always_inline void note_written(__u64 cgroup_id, struct inode *inode, bool mapping, __u64 now)
{
	struct write_key key = {
		.inode = (__u64)inode,
		.pid = bpf_get_current_pid_tgid() >> 32,
		.channel = mapping ? CHANNEL_MAPPING : CHANNEL_DESCRIPTOR,
	};
	note_recorded(&key, cgroup_id, now);
}

/*
 * The hot path (a process writing a file in a loop) is the test that the
 * write repeats one already recorded in this turn: it comes first, after only
 * direct loads through a BTF view of the file, before any path work.
 */
static __always_inline int record_file_write(__u64 cgroup_id, struct watch *watch,
					     struct file *file, __u32 via)
{
	if (!file)
		return 0;
	struct file *f = bpf_rdonly_cast(file, bpf_core_type_id_kernel(struct file));
	if (!(f->f_mode & FMODE_WRITE))
		return 0;
	struct inode *inode = f->f_inode;
	if (!inode || (inode->i_mode & S_IFMT) != S_IFREG)
		return 0;
	struct write_key key = {
		.inode = (__u64)inode,
		.pid = bpf_get_current_pid_tgid() >> 32,
		.channel = via == VIA_SHARED_MAPPING ? CHANNEL_MAPPING : CHANNEL_DESCRIPTOR,
	};
	if (recorded_this_turn(&key, cgroup_id, watch, current_start_ns()))
		return 0;
	if (!is_named_regular_file(file))
		return 0;
	__u64 now = bpf_ktime_get_ns();
	struct record *r = begin_in(cgroup_id, KIND_WRITE, SCRATCH_SYSCALL);
	if (!r)
		return 0;
	r->h.arg[0] = via;
	r->h.arg[1] = (__u64)inode;
	r->h.arg[2] = inode->i_ino;
	struct path_ref *ref = &r->h.path[0];
	ref->flags |= PATH_PRESENT;
	r->h.data_len = walk_path(ref, SCRATCH_SYSCALL, 0, BPF_CORE_READ(file, f_path.dentry),
				  BPF_CORE_READ(file, f_path.mnt));
	/* A checkpoint's parasite code runs inside the dumped task, ptrace-attached
	 * by CRIU, and logs through CRIU's descriptor of a host file: CRIU's doing,
	 * not the sandbox's. Any other file outside the root stays unresolved. */
	struct task_struct *task = bpf_get_current_task_btf();
	if ((ref->flags & PATH_OUTSIDE_ROOT) && task->ptrace)
		return 0;
	r->h.ts_ns = now;
	/* Not published (ring buffer full, counted lost): the next write tries again. */
	if (!publish(r))
		note_recorded(&key, cgroup_id, now);
	return 0;
}

/* Opens `watch` for the current task or returns from the program: the first
 * test of every write-like call, before the descriptor is looked at. */
#define WATCHED(cgroup_id, watch) \
	struct watch *watch; \
	__u64 cgroup_id = current_watch(&watch); \
	if (!cgroup_id || !watch) \
		return 0

#define FD_WRITE_CALL(call, fd, via) \
	ENTER(call) \
	{ \
		WATCHED(cgroup_id, watch); \
		return record_file_write(cgroup_id, watch, fd_file((int)(fd)), via); \
	}

/* Kept for its result like the path-based truncate, but only for files that
 * can be found by path (a memfd sized for a mapping is no file change). */
ENTER_EXIT(ftruncate)
{
	WATCHED(cgroup_id, watch);
	struct file *file = fd_file((int)ARG(0));
	if (!file || !is_named_regular_file(file))
		return 0;
	struct record *r = begin_in(cgroup_id, KIND_TRUNCATE, SCRATCH_SYSCALL);
	if (!r)
		return 0;
	__u32 off = 0;
	r->h.arg[0] = ARG(1);
	off = capture_fd(r, 0, SCRATCH_SYSCALL, off, ARG(0));
	return stash(r, off);
}

FD_WRITE_CALL(write, ARG(0), VIA_WRITE)
FD_WRITE_CALL(pwrite64, ARG(0), VIA_WRITE)
FD_WRITE_CALL(writev, ARG(0), VIA_WRITE)
FD_WRITE_CALL(pwritev, ARG(0), VIA_WRITE)
FD_WRITE_CALL(pwritev2, ARG(0), VIA_WRITE)
FD_WRITE_CALL(fallocate, ARG(0), VIA_FALLOCATE)
FD_WRITE_CALL(sendfile64, ARG(0), VIA_SENDFILE)
FD_WRITE_CALL(splice, ARG(2), VIA_SPLICE)
FD_WRITE_CALL(copy_file_range, ARG(2), VIA_COPY_FILE_RANGE)

/*
 * Writes through a shared mapping need no syscall at all, so the mapping is
 * the effect. Every MAP_SHARED mapping of a file open for writing counts,
 * writable or not: mprotect can add PROT_WRITE later without another look
 * at the file (VM_MAYWRITE comes from the open mode). The reader carries the
 * mapping into later turns in which its process runs.
 */
ENTER(mmap)
{
	__u64 type = ARG(3) & MAP_TYPE;
	if (type != MAP_SHARED && type != MAP_SHARED_VALIDATE)
		return 0;
	WATCHED(cgroup_id, watch);
	return record_file_write(cgroup_id, watch, fd_file((int)ARG(4)), VIA_SHARED_MAPPING);
}

/* bpf_find_vma callback: the file of a shared writable mapping, into `ctx` (a struct file **). */
static long shared_writable_file(struct task_struct *task, struct vm_area_struct *vma, void *ctx)
{
	__u64 flags = BPF_CORE_READ(vma, vm_flags);
	if ((flags & (VM_SHARED | VM_WRITE)) == (VM_SHARED | VM_WRITE))
		*(struct file **)ctx = BPF_CORE_READ(vma, vm_file);
	return 0;
}

/* msync says the process wrote through a shared writable mapping. */
ENTER(msync)
{
	WATCHED(cgroup_id, watch);
	struct file *file = NULL;
	bpf_find_vma(bpf_get_current_task_btf(), ARG(0), shared_writable_file, &file, 0);
	return record_file_write(cgroup_id, watch, file, VIA_MSYNC);
}

/* --- asynchronous I/O ------------------------------------------------------ */

/*
 * io_uring and Linux AIO do their reads and writes in the kernel, later and
 * without the syscalls above: the inspector cannot tell what they change.
 * Using them is the effect; it escalates the turn. Recorded at sys_enter, once
 * per process and call per turn (the written map dedups, as for writes), a
 * call that then fails included (over, never under).
 */
static __always_inline int record_async_io(__u32 call, __u64 setup_flags)
{
	WATCHED(cgroup_id, watch);
	struct write_key key = {
		.inode = call,
		.pid = bpf_get_current_pid_tgid() >> 32,
		.channel = CHANNEL_ASYNC_IO,
	};
	if (recorded_this_turn(&key, cgroup_id, watch, current_start_ns()))
		return 0;
	__u64 now = bpf_ktime_get_ns();
	struct record *r = begin_in(cgroup_id, KIND_ASYNC_IO, SCRATCH_SYSCALL);
	if (!r)
		return 0;
	r->h.arg[0] = call;
	r->h.arg[1] = setup_flags;
	r->h.ts_ns = now;
	if (!publish(r))
		note_recorded(&key, cgroup_id, now);
	return 0;
}

ENTER(io_uring_setup)
{
	/* struct io_uring_params: sq_entries, cq_entries, flags. Unreadable:
	 * assume a polling ring, which needs no syscall to submit. */
	__u32 flags;
	const __u32 *params = (const __u32 *)ARG(1);
	if (bpf_probe_read_user(&flags, sizeof(flags), &params[2]))
		flags = IORING_SETUP_SQPOLL;
	return record_async_io(ASYNC_IO_URING_SETUP, flags);
}
ENTER(io_uring_enter) { return record_async_io(ASYNC_IO_URING_ENTER, 0); }
ENTER(io_uring_register) { return record_async_io(ASYNC_IO_URING_REGISTER, 0); }
ENTER(io_submit) { return record_async_io(ASYNC_IO_SUBMIT, 0); }

/* --- sockets ---------------------------------------------------------- */

/* Copies a sockaddr from user memory into `extra`; an AF_UNIX path goes to
 * path0 (resolved against the cwd like any other path). */
static __always_inline int socket_addr_call(struct trace_event_raw_sys_enter *ctx, __u32 kind)
{
	const struct sockaddr *uaddr = (const struct sockaddr *)ARG(1);
	__u16 family = 0;
	if (bpf_probe_read_user(&family, sizeof(family), &uaddr->sa_family))
		return 0;
	if (family != AF_UNIX && family != AF_INET && family != AF_INET6)
		return 0;
	BEGIN(r, kind);
	if (family == AF_UNIX) {
		const char *sun_path = (const char *)uaddr + 2;
		char first = 0;
		bpf_probe_read_user(&first, 1, sun_path);
		__builtin_memcpy(r->h.extra, &family, sizeof(family));
		if (first == 0) {
			r->h.path[0].flags |= PATH_ABSTRACT;
			off = capture_verbatim(r, 0, off, sun_path + 1);
		} else {
			off = capture_at(r, 0, SCRATCH_SYSCALL, off, AT_FDCWD, sun_path);
		}
	} else {
		/* sockaddr_in is 16 bytes, sockaddr_in6 28. */
		__u32 len = family == AF_INET ? 16 : 28;
		if (len == 16)
			bpf_probe_read_user(r->h.extra, 16, uaddr);
		else
			bpf_probe_read_user(r->h.extra, 28, uaddr);
	}
	return stash(r, off);
}

ENTER_EXIT(bind) { return socket_addr_call(ctx, KIND_BIND); }
ENTER_EXIT(connect) { return socket_addr_call(ctx, KIND_CONNECT); }

/* listen() takes no address: read the bound one from the socket. */
ENTER_EXIT(listen)
{
	BEGIN(r, KIND_LISTEN);
	r->h.arg[0] = ARG(1);
	struct file *file = fd_file((int)ARG(0));
	struct socket *sock = file ? (struct socket *)BPF_CORE_READ(file, private_data) : NULL;
	struct sock *sk = sock ? BPF_CORE_READ(sock, sk) : NULL;
	if (sk) {
		__u16 family = BPF_CORE_READ(sk, __sk_common.skc_family);
		__u16 port = bpf_htons(BPF_CORE_READ(sk, __sk_common.skc_num));
		__builtin_memcpy(r->h.extra, &family, 2);
		__builtin_memcpy(r->h.extra + 2, &port, 2);
		if (family == AF_INET) {
			__u32 addr = BPF_CORE_READ(sk, __sk_common.skc_rcv_saddr);
			__builtin_memcpy(r->h.extra + 4, &addr, 4);
		} else if (family == AF_INET6) {
			BPF_CORE_READ_INTO(r->h.extra + 8, sk, __sk_common.skc_v6_rcv_saddr.in6_u.u6_addr8);
		}
	}
	return stash(r, off);
}

/* --- mounts --------------------------------------------------------------- */

ENTER_EXIT(mount)
{
	BEGIN(r, KIND_MOUNT);
	r->h.arg[0] = ARG(3);
	bpf_probe_read_user_str(r->h.extra, sizeof(r->h.extra), STR(2));
	off = capture_at(r, 0, SCRATCH_SYSCALL, off, AT_FDCWD, STR(1));
	off = capture_verbatim(r, 1, off, STR(0));
	return stash(r, off);
}
AT_CALL(umount, KIND_UMOUNT, AT_FDCWD, STR(0), ARG(1), 0)

/* --- processes ------------------------------------------------------------ */

SEC("tp_btf/sched_process_fork")
int BPF_PROG(on_fork, struct task_struct *parent, struct task_struct *child)
{
	/* New threads are not new processes. */
	if (BPF_CORE_READ(child, pid) != BPF_CORE_READ(child, tgid))
		return 0;
	struct record *r = begin(KIND_FORK, SCRATCH_SCHED);
	if (!r)
		return 0;
	r->h.arg[0] = BPF_CORE_READ(child, tgid);
	/*
	 * The child's pid as its own (innermost) pid namespace numbers it, and that
	 * namespace's depth: the newest of these is the namespace's cursor, which a
	 * restore sets again (CRIU restores pids, not the cursor). numbers[] has
	 * level + 1 entries, so numbers[level] is in bounds.
	 */
	struct pid *tp = BPF_CORE_READ(child, thread_pid);
	unsigned int level = BPF_CORE_READ(tp, level);
	struct upid innermost = {};
	if (tp && !bpf_probe_read_kernel(&innermost, sizeof(innermost),
					 (void *)tp + bpf_core_field_offset(struct pid, numbers) +
						 (__u64)level * bpf_core_type_size(struct upid))) {
		r->h.arg[1] = (__u32)innermost.nr;
		r->h.arg[2] = level;
	}
	r->h.ts_ns = bpf_ktime_get_ns();
	publish(r);
	return 0;
}

SEC("tp_btf/sched_process_exec")
int BPF_PROG(on_exec, struct task_struct *task, pid_t old_pid, struct linux_binprm *bprm)
{
	struct record *r = begin(KIND_EXEC, SCRATCH_SCHED);
	if (!r)
		return 0;
	__u32 off = 0;
	struct file *file = BPF_CORE_READ(bprm, file);
	struct path_ref *exe = &r->h.path[0];
	exe->flags |= PATH_PRESENT;
	if (file)
		off = walk_path(exe, SCRATCH_SCHED, off, BPF_CORE_READ(file, f_path.dentry),
				BPF_CORE_READ(file, f_path.mnt));
	else
		exe->flags |= PATH_UNRESOLVED;
	struct path_ref *given = &r->h.path[1];
	given->flags |= PATH_VERBATIM;
	off = copy_string(r, given, off, BPF_CORE_READ(bprm, filename), true);
	r->h.data_len = off;
	r->h.ts_ns = bpf_ktime_get_ns();
	publish(r);
	return 0;
}

SEC("tp_btf/sched_process_exit")
int BPF_PROG(on_exit, struct task_struct *task)
{
	__u32 tid = BPF_CORE_READ(task, pid);
	/* A thread killed inside a watched syscall never reaches sys_exit. */
	forget_pending(tid);
	if (tid != BPF_CORE_READ(task, tgid))
		return 0;
	struct record *r = begin(KIND_EXIT, SCRATCH_SCHED);
	if (!r)
		return 0;
	r->h.arg[0] = BPF_CORE_READ(task, exit_code);
	/* The leader can exit before its other threads: only a process with no
	 * live thread left has done all its writes. The count drops before this
	 * tracepoint on the kernels that pass it `group_dead`; where it does not
	 * yet, the process just never counts as gone (the reader then assumes
	 * it may still write). */
	r->h.arg[1] = BPF_CORE_READ(task, signal, live.counter) == 0;
	r->h.ts_ns = bpf_ktime_get_ns();
	publish(r);
	return 0;
}
