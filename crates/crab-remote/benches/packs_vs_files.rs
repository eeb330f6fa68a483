//! Packs vs one file per chunk, on the local disk: should crab's store keep page chunks in
//! packs too? Writes 16,384 chunks of 4 KiB (a 64 MiB process) durably three ways and reads
//! them back verified, printing times, files and bytes on disk, and ratios against the
//! one-file-per-chunk store of today (`files+fsync8`), all from one run:
//!
//! - `files+fsync`: each chunk its own file, written to tmp, fsync'd, renamed (the textbook way);
//! - `files+syncfs`: what crab's store did for a large batch until it wrote other sandboxes'
//!   queued write-outs too (tmp files, one `syncfs`, renames, a second `syncfs`);
//! - `files+fsync8`: what it does now (tmp files, writeback started for all, an fsync each over 8
//!   threads, renames, an fsync of each fan-out directory over 8 threads);
//! - `packs`: zstd-compressed packs of 4 MiB plus their indexes, each file fsync'd and renamed.
//!
//! Two contents: memory-like (the machine's own executables and libraries, cut in pages: code,
//! data and zero runs as in a process image) and random (incompressible, the worst case).
//! `cargo bench -p crab-remote --bench packs_vs_files`; `CRAB_BENCH_DIR` picks the directory
//! (default /var/tmp: the disk, not a tmpfs).

use std::fs::{self, File, OpenOptions};
use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crab_remote::Digest;
use crab_remote::pack::{self, ChunkIndex, PackIndex};

const CHUNKS: usize = 16_384;
const CHUNK: usize = 4096;

fn memory_like() -> Vec<Vec<u8>> {
    let mut data = Vec::with_capacity(CHUNKS * CHUNK);
    let mut stack = vec![PathBuf::from("/usr/lib/x86_64-linux-gnu"), PathBuf::from("/usr/bin")];
    while data.len() < CHUNKS * CHUNK {
        let Some(dir) = stack.pop() else { break };
        let Ok(entries) = fs::read_dir(&dir) else { continue };
        let mut paths: Vec<_> = entries.filter_map(|e| e.ok().map(|e| e.path())).collect();
        paths.sort();
        for path in paths {
            let Ok(meta) = fs::symlink_metadata(&path) else { continue };
            if meta.is_dir() {
                stack.push(path);
            } else if meta.is_file()
                && let Ok(bytes) = fs::read(&path)
            {
                data.extend_from_slice(&bytes[..bytes.len().min(CHUNKS * CHUNK - data.len())]);
                if data.len() >= CHUNKS * CHUNK {
                    break;
                }
            }
        }
    }
    data.resize(CHUNKS * CHUNK, 0);
    data.chunks(CHUNK).map(<[u8]>::to_vec).collect()
}

fn random() -> Vec<Vec<u8>> {
    let mut x = 0x2545_F491_4F6C_DD1Du64;
    (0..CHUNKS)
        .map(|_| {
            (0..CHUNK)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    x as u8
                })
                .collect()
        })
        .collect()
}

fn fsync_dir(dir: &Path) {
    File::open(dir).unwrap().sync_all().unwrap();
}

fn syncfs(dir: &Path) {
    let f = File::open(dir).unwrap();
    // SAFETY: syncfs takes a valid open descriptor, which `f` holds for the call.
    assert_eq!(unsafe { libc_syncfs(f.as_raw_fd()) }, 0, "syncfs");
}

unsafe extern "C" {
    #[link_name = "syncfs"]
    fn libc_syncfs(fd: i32) -> i32;
}

fn fanout(root: &Path) {
    for i in 0..=255u8 {
        fs::create_dir_all(root.join(format!("blobs/{i:02x}"))).unwrap();
    }
    fs::create_dir_all(root.join("tmp")).unwrap();
}

fn blob_path(root: &Path, d: &Digest) -> PathBuf {
    let hex = d.to_hex();
    root.join("blobs").join(&hex[..2]).join(&hex[2..])
}

fn write_tmp(root: &Path, i: usize, data: &[u8], fsync: bool) -> PathBuf {
    let tmp = root.join("tmp").join(i.to_string());
    let mut f = OpenOptions::new().write(true).create_new(true).open(&tmp).unwrap();
    f.write_all(data).unwrap();
    if fsync {
        f.sync_all().unwrap();
    }
    tmp
}

fn files_fsync(root: &Path, chunks: &[Vec<u8>]) {
    fanout(root);
    for (i, c) in chunks.iter().enumerate() {
        let tmp = write_tmp(root, i, c, true);
        fs::rename(tmp, blob_path(root, &Digest::of(c))).unwrap();
    }
    for i in 0..=255u8 {
        fsync_dir(&root.join(format!("blobs/{i:02x}")));
    }
}

fn files_syncfs(root: &Path, chunks: &[Vec<u8>]) {
    fanout(root);
    let tmps: Vec<_> = chunks.iter().enumerate().map(|(i, c)| (write_tmp(root, i, c, false), Digest::of(c))).collect();
    syncfs(root);
    for (tmp, d) in tmps {
        fs::rename(tmp, blob_path(root, &d)).unwrap();
    }
    syncfs(root);
}

/// `fsync` of each path over 8 threads, as the store does for a large batch.
fn fsync_over_threads(paths: &[PathBuf]) {
    std::thread::scope(|scope| {
        for share in paths.chunks(paths.len().div_ceil(8).max(1)) {
            scope.spawn(move || share.iter().for_each(|p| File::open(p).unwrap().sync_all().unwrap()));
        }
    });
}

fn files_fsync8(root: &Path, chunks: &[Vec<u8>]) {
    fanout(root);
    let tmps: Vec<_> = chunks.iter().enumerate().map(|(i, c)| (write_tmp(root, i, c, false), Digest::of(c))).collect();
    for (tmp, _) in &tmps {
        let f = File::open(tmp).unwrap();
        // SAFETY: sync_file_range on a descriptor `f` holds for the call; SYNC_FILE_RANGE_WRITE (2)
        // only starts writeback.
        assert_eq!(unsafe { libc_sync_file_range(f.as_raw_fd(), 0, 0, 2) }, 0, "sync_file_range");
    }
    let paths: Vec<PathBuf> = tmps.iter().map(|(tmp, _)| tmp.clone()).collect();
    fsync_over_threads(&paths);
    for (tmp, d) in tmps {
        fs::rename(tmp, blob_path(root, &d)).unwrap();
    }
    let dirs: Vec<PathBuf> = (0..=255u8).map(|i| root.join(format!("blobs/{i:02x}"))).collect();
    fsync_over_threads(&dirs);
}

unsafe extern "C" {
    #[link_name = "sync_file_range"]
    fn libc_sync_file_range(fd: i32, offset: i64, nbytes: i64, flags: u32) -> i32;
}

fn write_durable(dir: &Path, name: &str, bytes: &[u8]) {
    let tmp = dir.join(format!(".{name}.tmp"));
    let mut f = File::create(&tmp).unwrap();
    f.write_all(bytes).unwrap();
    f.sync_all().unwrap();
    fs::rename(tmp, dir.join(name)).unwrap();
}

fn packs(root: &Path, chunks: &[Vec<u8>]) {
    let dir = root.join("packs");
    fs::create_dir_all(&dir).unwrap();
    let objects = chunks.iter().map(|c| (Digest::of(c), &c[..]));
    for p in pack::pack_new(&ChunkIndex::new(), objects, pack::DEFAULT_PACK_TARGET, pack::DEFAULT_ZSTD_LEVEL).unwrap() {
        write_durable(&dir, &format!("{}.pack", p.digest().to_hex()), &p.bytes);
        write_durable(&dir, &format!("{}.idx", p.digest().to_hex()), &p.index.encode());
    }
    fsync_dir(&dir);
}

fn read_files(root: &Path, chunks: &[Vec<u8>]) {
    let mut buf = vec![0u8; CHUNK + 1];
    for c in chunks {
        let d = Digest::of(c);
        let mut f = File::open(blob_path(root, &d)).unwrap();
        let n = f.read(&mut buf).unwrap();
        assert_eq!(Digest::of(&buf[..n]), d);
    }
}

fn read_packs(root: &Path, chunks: &[Vec<u8>]) {
    let dir = root.join("packs");
    let mut index = ChunkIndex::new();
    for e in fs::read_dir(&dir).unwrap() {
        let path = e.unwrap().path();
        if path.extension().is_some_and(|x| x == "idx") {
            index.insert(PackIndex::decode(&fs::read(&path).unwrap()).unwrap());
        }
    }
    let mut reader = pack::ObjectReader::new().unwrap();
    let mut open: Option<(Digest, Vec<u8>)> = None;
    for c in chunks {
        let loc = *index.get(&Digest::of(c)).expect("indexed");
        if open.as_ref().is_none_or(|(d, _)| *d != loc.pack) {
            open = Some((loc.pack, fs::read(dir.join(format!("{}.pack", loc.pack.to_hex()))).unwrap()));
        }
        let (_, bytes) = open.as_ref().unwrap();
        reader.read(&loc.pack, bytes, &loc.entry).unwrap();
    }
}

/// Files and allocated bytes under `root`.
fn footprint(root: &Path) -> (u64, u64) {
    use std::os::unix::fs::MetadataExt;
    let mut stack = vec![root.to_owned()];
    let (mut files, mut bytes) = (0, 0);
    while let Some(dir) = stack.pop() {
        for e in fs::read_dir(&dir).unwrap() {
            let e = e.unwrap();
            let m = e.metadata().unwrap();
            if m.is_dir() {
                stack.push(e.path());
            } else {
                files += 1;
                bytes += m.blocks() * 512;
            }
        }
    }
    (files, bytes)
}

struct Row {
    name: &'static str,
    write: Duration,
    read: Duration,
    files: u64,
    bytes: u64,
}

fn run(base: &Path, label: &str, chunks: &[Vec<u8>]) {
    type Write = fn(&Path, &[Vec<u8>]);
    type Read = fn(&Path, &[Vec<u8>]);
    let ways: [(&str, Write, Read); 4] = [
        ("files+fsync", files_fsync, read_files),
        ("files+syncfs", files_syncfs, read_files),
        ("files+fsync8", files_fsync8, read_files),
        ("packs", packs, read_packs),
    ];
    let mut rows = Vec::new();
    for (name, write, read) in ways {
        let root = base.join(format!("{label}-{name}"));
        let _ = fs::remove_dir_all(&root);
        fs::create_dir_all(&root).unwrap();
        syncfs(&root);
        let t = Instant::now();
        write(&root, chunks);
        let write_time = t.elapsed();
        let t = Instant::now();
        read(&root, chunks);
        let read_time = t.elapsed();
        let (files, bytes) = footprint(&root);
        rows.push(Row { name, write: write_time, read: read_time, files, bytes });
        fs::remove_dir_all(&root).unwrap();
    }
    println!("\n{label}: {CHUNKS} chunks of {CHUNK} bytes ({} MiB)", (CHUNKS * CHUNK) >> 20);
    println!(
        "{:<14} {:>10} {:>10} {:>8} {:>10}   ratios vs files+fsync8 (today's store)",
        "way", "write ms", "read ms", "files", "disk MiB"
    );
    let today = &rows[2];
    for r in &rows {
        println!(
            "{:<14} {:>10.1} {:>10.1} {:>8} {:>10.1}   write {:.3}x  read {:.3}x  files {:.4}x  disk {:.3}x",
            r.name,
            r.write.as_secs_f64() * 1e3,
            r.read.as_secs_f64() * 1e3,
            r.files,
            r.bytes as f64 / (1 << 20) as f64,
            r.write.as_secs_f64() / today.write.as_secs_f64(),
            r.read.as_secs_f64() / today.read.as_secs_f64(),
            r.files as f64 / today.files as f64,
            r.bytes as f64 / today.bytes as f64,
        );
    }
}

fn main() {
    // `cargo test --benches` runs this with --bench absent: only a real bench run measures.
    if !std::env::args().any(|a| a == "--bench") {
        return;
    }
    let base = PathBuf::from(std::env::var("CRAB_BENCH_DIR").unwrap_or_else(|_| "/var/tmp".into()))
        .join(format!("crab-packs-bench-{}", std::process::id()));
    fs::create_dir_all(&base).unwrap();
    run(&base, "memory-like", &memory_like());
    run(&base, "random", &random());
    let _ = fs::remove_dir_all(&base);
}
