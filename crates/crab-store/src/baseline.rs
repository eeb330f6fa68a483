//! The `every-turn` baseline: what containerd users have today (`ctr c checkpoint --task --rw`).
//! After every turn, a plain CRIU checkpoint plus the container's whole rootfs diff (its overlay
//! upper layer) are written out as they are: no content addressing, no dedup, nothing shared
//! with earlier turns. Its traffic is counted like the store's (content bytes plus the bytes
//! of the index describing them), so the two compare fairly.
//!
//! Layout: `full/<container>/turn-<N>/{criu/, rw/, index.json}`, written under a tmp name,
//! flushed, renamed into place; the previous turn's checkpoint is then removed (only the latest
//! is ever restored, as with a checkpoint image that is replaced).

use rustix::fs::OFlags;
use std::ffi::OsStr;
use std::fs::{self, File};
use std::io::{Read, Write};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use serde::Serialize;

use super::chain::sandbox_key;
use super::error::{CheckpointError, IoContext, Result};
use super::key::full_checkpoints_dir;
use super::sys;

/// What one baseline checkpoint wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FullCheckpoint {
    pub dir: PathBuf,
    pub turn: u64,
    /// Content bytes of every file written plus the index.
    pub bytes_written: u64,
    pub files: u64,
}

#[derive(Serialize)]
struct IndexEntry {
    path: String,
    kind: &'static str,
    mode: u32,
    uid: u32,
    gid: u32,
    size: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    target: Option<String>,
}

/// The upper (writable) layer of the overlay that is `pid`'s root: the container's rootfs diff.
pub fn overlay_upperdir(pid: u32) -> Result<PathBuf> {
    let path = PathBuf::from(format!("/proc/{pid}/mountinfo"));
    let mountinfo = fs::read_to_string(&path).io_ctx("read", &path)?;
    upperdir_of_root(&mountinfo)
        .map_err(|reason| CheckpointError::InvalidRequest(format!("root of pid {pid}: {reason}")))
}

fn upperdir_of_root(mountinfo: &str) -> std::result::Result<PathBuf, &'static str> {
    let root =
        mountinfo.lines().find(|l| l.split_whitespace().nth(4) == Some("/")).ok_or("no mount at / in its mountinfo")?;
    let (_, fs_part) = root.split_once(" - ").ok_or("malformed mountinfo line")?;
    let mut fields = fs_part.split_whitespace();
    if fields.next() != Some("overlay") {
        return Err("not an overlay mount, so it has no rootfs diff");
    }
    let options = fields.nth(1).unwrap_or_default();
    options.split(',').find_map(|o| o.strip_prefix("upperdir=")).map(PathBuf::from).ok_or("overlay without an upperdir")
}

/// Writes the baseline checkpoint of `turn`: the CRIU image directory and the rootfs diff,
/// copied whole and flushed. Returns once it is durable.
pub fn write_full_checkpoint(
    state_dir: &Path,
    container: &str,
    turn: u64,
    criu_images: &Path,
    rootfs_diff: &Path,
) -> Result<FullCheckpoint> {
    let parent = full_checkpoints_dir(state_dir, &sandbox_key(container)?);
    sys::create_private_dir_all(&parent).io_ctx("create", &parent)?;
    let tmp = parent.join(format!(".turn-{turn}.tmp"));
    let _ = fs::remove_dir_all(&tmp);
    let written = copy_checkpoint(&tmp, criu_images, rootfs_diff);
    let copier = match written {
        Ok(copier) => copier,
        Err(e) => {
            let _ = fs::remove_dir_all(&tmp);
            return Err(e);
        }
    };
    let dest = parent.join(format!("turn-{turn}"));
    let published = (|| {
        sys::syncfs(File::open(&tmp).io_ctx("open", &tmp)?.as_fd()).io_ctx("syncfs", &tmp)?;
        let _ = fs::remove_dir_all(&dest);
        fs::rename(&tmp, &dest).io_ctx("rename", &dest)?;
        sys::fsync_dir(&parent).io_ctx("fsync", &parent)
    })();
    if let Err(e) = published {
        let _ = fs::remove_dir_all(&tmp);
        return Err(e);
    }
    // Only the newest is kept; removing older ones costs no write traffic.
    for dirent in fs::read_dir(&parent).io_ctx("read dir", &parent)? {
        let dirent = dirent.io_ctx("read dir", &parent)?;
        let name = dirent.file_name();
        let older = name
            .to_str()
            .and_then(|n| n.strip_prefix("turn-"))
            .and_then(|n| n.parse::<u64>().ok())
            .is_some_and(|t| t < turn);
        if older {
            let _ = fs::remove_dir_all(dirent.path());
        }
    }
    Ok(FullCheckpoint { dir: dest, turn, bytes_written: copier.bytes, files: copier.files })
}

/// Removes a container's baseline checkpoints.
pub fn remove_full_checkpoints(state_dir: &Path, container: &str) -> Result<()> {
    let dir = full_checkpoints_dir(state_dir, &sandbox_key(container)?);
    match fs::remove_dir_all(&dir) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e).io_ctx("remove", dir),
        _ => Ok(()),
    }
}

#[derive(Default)]
struct Copier {
    bytes: u64,
    files: u64,
    index: Vec<IndexEntry>,
}

fn copy_checkpoint(tmp: &Path, criu_images: &Path, rootfs_diff: &Path) -> Result<Copier> {
    let mut copier = Copier::default();
    sys::create_private_dir_all(tmp).io_ctx("create", tmp)?;
    copier.copy_tree(criu_images, &tmp.join("criu"), "criu")?;
    copier.copy_tree(rootfs_diff, &tmp.join("rw"), "rw")?;
    let index =
        serde_json::to_vec(&copier.index).map_err(|source| CheckpointError::Json { what: "baseline index", source })?;
    let path = tmp.join("index.json");
    File::create(&path).and_then(|mut f| f.write_all(&index)).io_ctx("write", &path)?;
    copier.bytes += index.len() as u64;
    Ok(copier)
}

impl Copier {
    /// Copies the tree at `from` (a host path) to `to`.
    fn copy_tree(&mut self, from: &Path, to: &Path, rel: &str) -> Result<()> {
        let root = sys::open_dir_path(from).io_ctx("open", from)?;
        self.copy_entry(root, from, to, rel)
    }

    /// Copies the entry `handle` holds (an `O_PATH` handle) as it is. The rootfs diff belongs
    /// to the container, which may swap any name meanwhile: what an entry is gets decided on
    /// its handle, its content is read through it, and children are opened from the open
    /// directory, never by path. Overlay whiteouts (0/0 character devices) and other special
    /// files are recorded in the index only, never opened.
    fn copy_entry(&mut self, handle: OwnedFd, from: &Path, to: &Path, rel: &str) -> Result<()> {
        let st = sys::fstat(handle.as_fd()).io_ctx("stat", from)?;
        let mut entry = IndexEntry {
            path: rel.to_owned(),
            kind: "special",
            mode: st.st_mode & 0o7777,
            uid: st.st_uid,
            gid: st.st_gid,
            size: 0,
            target: None,
        };
        match sys::file_type(&st) {
            libc::S_IFDIR => {
                entry.kind = "dir";
                let dir = sys::reopen(handle.as_fd(), OFlags::RDONLY | OFlags::DIRECTORY).io_ctx("open", from)?;
                fs::create_dir(to).io_ctx("create", to)?;
                self.index.push(entry);
                for name in sys::read_dir_names(dir.as_fd()).io_ctx("read dir", from)? {
                    let (child_from, child_to) =
                        (from.join(OsStr::from_bytes(&name)), to.join(OsStr::from_bytes(&name)));
                    let name_c = sys::cstr(&name).io_ctx("read dir", from)?;
                    fail::fail_point!("baseline-copy-open");
                    // Removed since the listing: it is not part of this checkpoint.
                    let Some(child) = sys::open_entry_opt(dir.as_fd(), &name_c).io_ctx("open", &child_from)? else {
                        continue;
                    };
                    let child_rel = format!("{rel}/{}", String::from_utf8_lossy(&name));
                    self.copy_entry(child, &child_from, &child_to, &child_rel)?;
                }
                return Ok(());
            }
            libc::S_IFREG => {
                entry.kind = "file";
                fail::fail_point!("baseline-copy-read");
                let src = File::from(sys::reopen(handle.as_fd(), OFlags::RDONLY).io_ctx("open", from)?);
                let mut dst = File::create(to).io_ctx("create", to)?;
                // Never past the size seen at open: a file still growing cannot keep us copying.
                entry.size = std::io::copy(&mut (&src).take(st.st_size.max(0) as u64), &mut dst).io_ctx("copy", to)?;
                dst.set_permissions(fs::Permissions::from_mode(entry.mode)).io_ctx("chmod", to)?;
                self.bytes += entry.size;
                self.files += 1;
            }
            libc::S_IFLNK => {
                entry.kind = "symlink";
                let target = sys::readlink_entry(handle.as_fd()).io_ctx("readlink", from)?;
                std::os::unix::fs::symlink(OsStr::from_bytes(&target), to).io_ctx("symlink", to)?;
                entry.target = Some(String::from_utf8_lossy(&target).into_owned());
            }
            _ => {}
        }
        self.index.push(entry);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_turn_writes_everything_again_and_keeps_only_the_newest() {
        let tmp = tempfile::tempdir().unwrap();
        let (images, diff, state) = (tmp.path().join("img"), tmp.path().join("upper"), tmp.path().join("state"));
        fs::create_dir_all(&images).unwrap();
        fs::create_dir_all(diff.join("app")).unwrap();
        fs::write(images.join("pages-1.img"), vec![7u8; 8192]).unwrap();
        fs::write(diff.join("app/a.txt"), b"same content").unwrap();
        std::os::unix::fs::symlink("a.txt", diff.join("app/link")).unwrap();
        let first = write_full_checkpoint(&state, "c", 1, &images, &diff).unwrap();
        assert_eq!(first.files, 2);
        assert!(first.bytes_written > 8192 + 12, "{first:?}");
        // Nothing changed: the baseline still writes it all again (no dedup).
        let second = write_full_checkpoint(&state, "c", 2, &images, &diff).unwrap();
        assert_eq!(second.bytes_written, first.bytes_written);
        assert!(!first.dir.exists(), "the older checkpoint is replaced");
        assert_eq!(fs::read(second.dir.join("rw/app/a.txt")).unwrap(), b"same content");
        assert_eq!(fs::read_link(second.dir.join("rw/app/link")).unwrap(), Path::new("a.txt"));
        assert_eq!(fs::read(second.dir.join("criu/pages-1.img")).unwrap().len(), 8192);
        let leftovers: Vec<_> = fs::read_dir(second.dir.parent().unwrap()).unwrap().collect();
        assert_eq!(leftovers.len(), 1);
        assert!(write_full_checkpoint(&state, "../x", 3, &images, &diff).is_err());
        remove_full_checkpoints(&state, "c").unwrap();
        assert!(!second.dir.exists());
    }

    /// A container swaps a file of its rootfs diff for a symlink to a host file while the
    /// baseline copies it: the host file must not end up in the checkpoint.
    #[test]
    fn a_file_swapped_for_a_link_to_the_host_is_not_copied_through_it() {
        let tmp = tempfile::tempdir().unwrap();
        let (images, diff, state) = (tmp.path().join("img"), tmp.path().join("upper"), tmp.path().join("state"));
        fs::create_dir_all(&images).unwrap();
        fs::create_dir_all(&diff).unwrap();
        let secret = tmp.path().join("host-secret");
        fs::write(&secret, b"HOST-SECRET").unwrap();
        fs::write(diff.join("f"), b"mine").unwrap();
        let scenario = fail::FailScenario::setup();
        let (link_to, at) = (secret.clone(), diff.join("f"));
        let swapped = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let once = swapped.clone();
        fail::cfg_callback("baseline-copy-read", move || {
            if !once.swap(true, std::sync::atomic::Ordering::SeqCst) {
                fs::remove_file(&at).unwrap();
                std::os::unix::fs::symlink(&link_to, &at).unwrap();
            }
        })
        .unwrap();
        let written = write_full_checkpoint(&state, "c", 1, &images, &diff);
        scenario.teardown();
        assert!(swapped.load(std::sync::atomic::Ordering::SeqCst), "the failpoint never ran");
        let dir = written.expect("the checkpoint is written").dir;
        let copied = fs::symlink_metadata(dir.join("rw/f")).unwrap();
        if copied.file_type().is_file() {
            assert_eq!(fs::read(dir.join("rw/f")).unwrap(), b"mine", "the host file was copied");
        } else {
            assert!(copied.file_type().is_symlink());
        }
    }

    #[test]
    fn the_rootfs_diff_is_the_upper_layer_of_an_overlay_root_only() {
        let overlay = "612 540 0:61 / / rw,relatime - overlay overlay rw,lowerdir=/l,upperdir=/u/fs,workdir=/w\n";
        assert_eq!(upperdir_of_root(overlay), Ok(PathBuf::from("/u/fs")));
        let ext4 = "25 1 254:1 / / rw,relatime - ext4 /dev/vda rw\n";
        assert!(upperdir_of_root(ext4).unwrap_err().contains("not an overlay"));
        let err = overlay_upperdir(u32::MAX).unwrap_err().to_string();
        assert!(err.contains(&format!("/proc/{}/mountinfo", u32::MAX)), "{err}");
    }
}
