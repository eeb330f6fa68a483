/* SPDX-License-Identifier: GPL-2.0 OR Apache-2.0 */
/*
 * Layout of the records the inspector's BPF programs put on the ring buffer.
 * src/inspector/record.rs decodes exactly this layout: change both together.
 */
#ifndef CRAB_INSPECTOR_H
#define CRAB_INSPECTOR_H

/* Bytes of path data a record may use before strings are cut short. */
#define DATA_CAP 8192
/* Longest user string read in one go (PATH_MAX). */
#define USER_MAX 4096
/* The data area has room for one more longest string read past DATA_CAP, so
 * a read that starts below DATA_CAP always stays inside the buffer. */
#define DATA_BUF (DATA_CAP + USER_MAX)
/* Longest dentry name (NAME_MAX) plus its NUL. */
#define NAME_READ 256
/* Directory levels walked up before a path counts as unresolved. */
#define MAX_DEPTH 64
/* cgroup levels checked for a watched ancestor. */
#define MAX_CGROUP_LEVEL 16
/* Bit of `watched_levels`: some watched cgroup's level is not known (or is
 * MAX_CGROUP_LEVEL or deeper), so every level is looked at. */
#define LEVELS_UNKNOWN (1U << 31)
/* Watched cgroup ids the early exit compares with directly, before any hash
 * lookup (see struct watch_filter). */
#define WATCHED_IDS 8

enum record_kind {
	KIND_OPEN = 1, /* arg0: flags, arg1: mode, arg2: inode (as KIND_WRITE) when it is a regular file open for writing */
	KIND_TRUNCATE = 2,
	KIND_UNLINK = 3, /* arg0: unlinkat flags (AT_REMOVEDIR) */
	KIND_RENAME = 4, /* path0: from, path1: to, arg0: renameat2 flags */
	KIND_MKDIR = 5,
	KIND_RMDIR = 6,
	KIND_LINK = 7,    /* path0: new name, path1: existing file */
	KIND_SYMLINK = 8, /* path0: new link, path1: target text (verbatim) */
	KIND_CHMOD = 9,
	KIND_CHOWN = 10, /* arg0: uid, arg1: gid */
	KIND_SETXATTR = 11, /* extra: attribute name */
	KIND_REMOVEXATTR = 12,
	KIND_MKNOD = 13, /* arg0: mode, arg1: dev */
	KIND_UTIMES = 14,
	/* Data written to a regular file through a descriptor, or a shared
	 * mapping of it that the process can write through (no syscall per
	 * write). path0: the file, resolved from the descriptor; arg0: enum
	 * write_via; arg1: the inode's kernel address (the dedup key, stable
	 * while the file is open); arg2: the inode number. */
	KIND_WRITE = 15,
	/* A call that hands I/O to the kernel to do later, out of the
	 * inspector's sight (io_uring, Linux AIO): what it writes is unknown.
	 * arg0: enum async_io_call; arg1: io_uring_setup's flags (SQPOLL: the
	 * process can submit with no syscall at all from then on). */
	KIND_ASYNC_IO = 16,

	KIND_BIND = 32,    /* extra: sockaddr; AF_UNIX path in path0 */
	KIND_LISTEN = 33,  /* extra: sockaddr of the bound address, arg0: backlog */
	KIND_CONNECT = 34, /* extra: sockaddr; AF_UNIX path in path0 */

	KIND_MOUNT = 48,      /* path0: target, path1: source (verbatim), extra: fs type, arg0: flags */
	KIND_UMOUNT = 49,     /* path0: target, arg0: flags */
	KIND_MOVE_MOUNT = 50, /* path0: to, path1: from */

	KIND_FORK = 64, /* arg0: child pid */
	KIND_EXEC = 65, /* path0: executable (resolved), path1: filename as passed */
	KIND_EXIT = 66, /* arg0: exit code (wait status), arg1: 1 when no thread of the process is left */
};

enum write_via {
	VIA_WRITE = 1, /* write, pwrite64, writev, pwritev, pwritev2 */
	VIA_FALLOCATE = 2,
	VIA_SENDFILE = 3,
	VIA_SPLICE = 4,
	VIA_COPY_FILE_RANGE = 5,
	VIA_SHARED_MAPPING = 6, /* mmap MAP_SHARED of a file open for writing */
	VIA_MSYNC = 7,
};

enum async_io_call {
	ASYNC_IO_URING_SETUP = 1,
	ASYNC_IO_URING_ENTER = 2,
	ASYNC_IO_URING_REGISTER = 3,
	ASYNC_IO_SUBMIT = 4,
};

/* Value of the `watched` map: per watched cgroup. */
struct watch {
	/* Turn boundary (CLOCK_MONOTONIC ns): the first write of a process to a
	 * file after it is recorded again. Set by the reader at each drain. */
	__u64 epoch_ns;
};

/* What the early exit of every program reads first (the `.data.levels`
 * section, which the reader rewrites whole at each watch and unwatch). */
struct watch_filter {
	/* Bit n: a watched cgroup is at level n below the cgroup v2 root;
	 * LEVELS_UNKNOWN: one is watched whose level the reader could not tell. */
	__u32 levels;
	/* Watched cgroups, all in `ids` while there are at most WATCHED_IDS.
	 * With more, `ids` is not used: every ancestor at a watched level is
	 * looked up in `watched`. */
	__u32 nr_ids;
	__u64 ids[WATCHED_IDS];
};

/* What a `written` key counts: writes to one file, or calls of one kind. */
enum write_channel {
	CHANNEL_DESCRIPTOR = 0,
	CHANNEL_MAPPING = 1, /* VIA_SHARED_MAPPING (tracked apart: it outlives the call) */
	CHANNEL_ASYNC_IO = 2, /* `inode` holds the enum async_io_call instead */
};

/* Key and value of the `written` map, which keeps a tight write loop from
 * flooding the ring buffer: one KIND_WRITE (or KIND_ASYNC_IO) record per key
 * per turn. */
struct write_key {
	__u64 inode; /* kernel address of the file's inode */
	__u32 pid;   /* thread group id */
	__u32 channel; /* enum write_channel */
};

struct write_seen {
	__u64 recorded_ns; /* time of the record last published for this key */
	__u64 last_ns;	   /* time of the latest timed write, recorded or not */
	__u64 cgroup_id;
	/* Start time of the writing process (its thread group leader): a hit
	 * must come from the process that made the record, not from a later
	 * one that reused its pid. */
	__u64 start_ns;
	/* 1 when a process started in the turn of the record wrote again after
	 * it without taking the time (see recorded_this_turn): the reader then
	 * asks whether the process was gone by the turn's end. */
	__u32 untimed;
	__u32 pad;
};

/* Per-path flags. */
#define PATH_PRESENT 0x1
#define PATH_VERBATIM 0x2	 /* text kept as given, never joined to a base */
#define PATH_UNRESOLVED 0x4	 /* the base directory could not be walked to the root */
#define PATH_TRUNCATED 0x8	 /* the data area ran out */
#define PATH_FAULT 0x10		 /* the user string could not be read */
#define PATH_OUTSIDE_ROOT 0x20	 /* the walk passed the global root without meeting the process root */
#define PATH_ABSTRACT 0x40	 /* AF_UNIX abstract socket name */

/*
 * A path is `base` (the directory it is relative to, resolved in the kernel:
 * its components from the leaf up, each NUL-terminated) joined with `user`
 * (the string the process passed, NUL-terminated). An absolute user string
 * has no base.
 */
struct path_ref {
	__u16 base_off;
	__u16 base_len;
	__u16 user_off;
	__u16 user_len;
	__u32 flags;
	__u32 pad;
};

struct record_header {
	__u32 kind;
	__u32 pad0;
	__u32 pid; /* thread group id */
	__u32 tid;
	__u64 cgroup_id; /* the watched cgroup the task is in (or under) */
	__u64 ts_ns;	 /* CLOCK_MONOTONIC at the syscall's exit */
	__s64 ret;
	__u64 arg[3];
	char comm[16];
	struct path_ref path[2];
	__u8 extra[32];
	__u32 data_len;
	__u32 pad1;
};

struct record {
	struct record_header h;
	char data[DATA_BUF];
	/* Never published (only the header and data_len bytes of data are).
	 * The user address of each path string whose read at sys_enter failed
	 * (PATH_FAULT), because its page was not paged in yet: sys_exit reads it
	 * again once the call has faulted the page in. 0 when there is none. */
	__u64 retry_str[2];
};

/* The Rust decoder hard-codes these offsets. */
_Static_assert(sizeof(struct path_ref) == 16, "path_ref layout");
_Static_assert(sizeof(struct watch) == 8, "watch layout");
_Static_assert(sizeof(struct watch_filter) == 8 + 8 * WATCHED_IDS, "watch_filter layout");
_Static_assert(sizeof(struct write_key) == 16, "write_key layout");
_Static_assert(sizeof(struct write_seen) == 40, "write_seen layout");
_Static_assert(sizeof(struct record_header) == 152, "record_header layout");
_Static_assert(__builtin_offsetof(struct record_header, comm) == 64, "comm offset");
_Static_assert(__builtin_offsetof(struct record_header, path) == 80, "path offset");
_Static_assert(__builtin_offsetof(struct record_header, extra) == 112, "extra offset");
_Static_assert(__builtin_offsetof(struct record_header, data_len) == 144, "data_len offset");

#endif
