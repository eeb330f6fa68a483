//! Fields of `/proc/<pid>/stat`, read the one way every crate of crab reads them. The command's
//! name comes before them in parentheses and is whatever the process set (`prctl(PR_SET_NAME)`,
//! `/proc/self/comm`, or the name of the file it executed): any bytes, spaces, parentheses and
//! invalid UTF-8 included. A sandbox's processes choose theirs, so the file is read as bytes and
//! the fields after the *last* `)`: a name can neither shift them nor make the line unreadable
//! (read as text, a name that is not UTF-8 made a container's init look gone to crabd).

use std::path::PathBuf;

/// `/proc/<pid>/stat`, as bytes.
pub fn read(pid: u32) -> std::io::Result<Vec<u8>> {
    std::fs::read(path(pid))
}

/// `/proc/<pid>/stat`.
pub fn path(pid: u32) -> PathBuf {
    PathBuf::from(format!("/proc/{pid}/stat"))
}

/// The fields after the command's name: field 3 (the state) first.
fn fields(stat: &[u8]) -> Option<impl Iterator<Item = &[u8]>> {
    let close = stat.iter().rposition(|byte| *byte == b')')?;
    Some(stat[close + 1..].split(u8::is_ascii_whitespace).filter(|field| !field.is_empty()))
}

/// Field `number` (1-based, as proc(5) counts them), from 3 on.
fn field(stat: &[u8], number: usize) -> Option<&[u8]> {
    fields(stat)?.nth(number.checked_sub(3)?)
}

fn number<T: std::str::FromStr>(field: &[u8]) -> Option<T> {
    std::str::from_utf8(field).ok()?.parse().ok()
}

/// The command's name (field 2), without its parentheses.
pub fn name(stat: &[u8]) -> Option<&[u8]> {
    let open = stat.iter().position(|byte| *byte == b'(')?;
    let close = stat.iter().rposition(|byte| *byte == b')')?;
    stat.get(open + 1..close)
}

/// The state letter (field 3): `R` running, `S` asleep, `D` in uninterruptible I/O, `Z` a
/// zombie, ...
pub fn state(stat: &[u8]) -> Option<char> {
    field(stat, 3)?.first().map(|letter| char::from(*letter))
}

/// The parent's pid (field 4).
pub fn parent(stat: &[u8]) -> Option<u32> {
    number(field(stat, 4)?)
}

/// When the process started, in clock ticks after boot (field 22): with the pid, what
/// tells a process from a later one that got its number.
pub fn start_time(stat: &[u8]) -> Option<u64> {
    number(field(stat, 22)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fields_are_read_after_the_last_parenthesis_whatever_the_name_holds() {
        let stat = b"4242 (sh) x (y) S 17 4242 4242 0 -1 4194560 100 0 0 0";
        assert_eq!((state(stat), parent(stat)), (Some('S'), Some(17)));
        assert_eq!(name(stat), Some(&b"sh) x (y"[..]));
        assert_eq!(parent(b"42 (a b) c) R 7 42 42 0"), Some(7));
        assert_eq!(state(b"99 (sleep) Z 1 99 99"), Some('Z'));
        // A name that is not UTF-8.
        assert_eq!((state(b"5 (\xff\xfe)) D 1 5"), parent(b"5 (\xff\xfe)) D 1 5")), (Some('D'), Some(1)));
        assert_eq!(name(b"5 (\xff\xfe)) D 1 5"), Some(&b"\xff\xfe)"[..]));
        assert_eq!((state(b"7 (sleep)"), parent(b"7 (sleep) S")), (None, None));
        assert_eq!((state(b"garbage"), parent(b"garbage"), name(b"garbage")), (None, None, None));
    }

    #[test]
    fn the_start_time_is_field_22() {
        let line = b"42 (tmux: server) S 1 42 42 0 -1 4194560 500 0 0 0 3 1 0 0 20 0 1 0 123456 9000 100";
        assert_eq!(start_time(line), Some(123456));
        assert_eq!(start_time(b"7 (a) b) R 1"), None, "too few fields");
    }

    /// The file a process executed names it: a name that is not UTF-8 is one `execve` away.
    #[test]
    fn a_live_process_named_in_bytes_that_are_not_utf8_is_read() {
        use std::os::unix::ffi::OsStrExt;
        let dir = tempfile::tempdir().unwrap();
        let link = dir.path().join(std::ffi::OsStr::from_bytes(b"\xff\xfe-sleep"));
        std::os::unix::fs::symlink("/bin/sleep", &link).unwrap();
        let mut child = std::process::Command::new(&link).arg("30").spawn().unwrap();
        let stat = read(child.id()).unwrap();
        let read_as_text = std::fs::read_to_string(path(child.id())).is_ok();
        let fields = (name(&stat), parent(&stat), start_time(&stat).is_some());
        child.kill().unwrap();
        child.wait().unwrap();
        assert!(!read_as_text, "the kernel gave the name as it is");
        assert_eq!(fields, (Some(&b"\xff\xfe-sleep"[..]), Some(std::process::id()), true));
    }
}
