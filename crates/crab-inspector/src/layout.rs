//! The byte layouts the decoder reads (ring buffer records, the write-dedup map's keys and
//! values) tied to the C definitions: the skeleton generates Rust types for them from the BPF
//! object's BTF (the `crab_layouts` global in `inspector.bpf.c` exists for that), and the
//! offsets `record.rs` and `writes.rs` use are checked against those types when this crate
//! compiles. A change to `inspector.h` that moves a field no longer decodes garbage: it fails
//! the build.

use std::mem::{offset_of, size_of};

use crate::record::{
    EXTRA_LEN, HEADER_LEN, OFF_ARG, OFF_CGROUP, OFF_COMM, OFF_EXTRA, OFF_KIND, OFF_PATH, OFF_PID, OFF_RET, OFF_TID,
    OFF_TS, PATH_REF_FLAGS, PATH_REF_LEN,
};
use crate::skel::types::{path_ref, record_header, watch_filter, write_key, write_seen};
use crate::writes::{
    WK_CHANNEL, WK_INODE, WK_PID, WRITE_KEY_LEN, WRITE_SEEN_LEN, WS_CGROUP, WS_LAST, WS_RECORDED, WS_START, WS_UNTIMED,
};
use crate::{WATCH_FILTER_LEN, WATCHED_IDS, WF_IDS, WF_LEVELS, WF_NR_IDS};

const _: () = {
    assert!(size_of::<record_header>() == HEADER_LEN);
    assert!(offset_of!(record_header, kind) == OFF_KIND);
    assert!(offset_of!(record_header, pid) == OFF_PID);
    assert!(offset_of!(record_header, tid) == OFF_TID);
    assert!(offset_of!(record_header, cgroup_id) == OFF_CGROUP);
    assert!(offset_of!(record_header, ts_ns) == OFF_TS);
    assert!(offset_of!(record_header, ret) == OFF_RET);
    assert!(offset_of!(record_header, arg) == OFF_ARG);
    assert!(offset_of!(record_header, comm) == OFF_COMM);
    assert!(offset_of!(record_header, path) == OFF_PATH);
    assert!(offset_of!(record_header, extra) == OFF_EXTRA);
    assert!(offset_of!(record_header, data_len) == OFF_EXTRA + EXTRA_LEN);

    assert!(size_of::<path_ref>() == PATH_REF_LEN);
    assert!(offset_of!(path_ref, base_off) == 0);
    assert!(offset_of!(path_ref, base_len) == 2);
    assert!(offset_of!(path_ref, user_off) == 4);
    assert!(offset_of!(path_ref, user_len) == 6);
    assert!(offset_of!(path_ref, flags) == PATH_REF_FLAGS);

    assert!(size_of::<write_key>() == WRITE_KEY_LEN);
    assert!(offset_of!(write_key, inode) == WK_INODE);
    assert!(offset_of!(write_key, pid) == WK_PID);
    assert!(offset_of!(write_key, channel) == WK_CHANNEL);

    assert!(size_of::<watch_filter>() == WATCH_FILTER_LEN);
    assert!(offset_of!(watch_filter, levels) == WF_LEVELS);
    assert!(offset_of!(watch_filter, nr_ids) == WF_NR_IDS);
    assert!(offset_of!(watch_filter, ids) == WF_IDS);
    assert!(size_of::<[u64; WATCHED_IDS]>() == size_of::<watch_filter>() - WF_IDS);

    assert!(size_of::<write_seen>() == WRITE_SEEN_LEN);
    assert!(offset_of!(write_seen, recorded_ns) == WS_RECORDED);
    assert!(offset_of!(write_seen, last_ns) == WS_LAST);
    assert!(offset_of!(write_seen, cgroup_id) == WS_CGROUP);
    assert!(offset_of!(write_seen, start_ns) == WS_START);
    assert!(offset_of!(write_seen, untimed) == WS_UNTIMED);
};
