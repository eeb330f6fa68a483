//! Fields of `/proc/<pid>/stat`, as the fault injector, the fingerprint and the settle step
//! read them. The command's name comes before them in parentheses and is whatever the
//! process set (`prctl(PR_SET_NAME)`): any bytes, spaces, parentheses and invalid UTF-8
//! included. A sandbox's processes choose theirs, so the fields are read after the *last*
//! `)` and as bytes: a name cannot shift them, and no name hides a process from a reader
//! that wants text.

/// The fields after the command's name.
fn fields(stat: &[u8]) -> Option<impl Iterator<Item = &[u8]>> {
    let close = stat.iter().rposition(|byte| *byte == b')')?;
    Some(stat[close + 1..].split(u8::is_ascii_whitespace).filter(|field| !field.is_empty()))
}

/// The state letter: `R` running, `S` asleep, `D` in uninterruptible I/O, `Z` a zombie, ...
pub fn state(stat: &[u8]) -> Option<char> {
    fields(stat)?.next()?.first().map(|letter| char::from(*letter))
}

/// The parent's pid.
pub fn parent(stat: &[u8]) -> Option<u32> {
    std::str::from_utf8(fields(stat)?.nth(1)?).ok()?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fields_are_read_after_the_last_parenthesis_whatever_the_name_holds() {
        let stat = b"4242 (sh) x (y) S 17 4242 4242 0 -1 4194560 100 0 0 0";
        assert_eq!((state(stat), parent(stat)), (Some('S'), Some(17)));
        assert_eq!(parent(b"42 (a b) c) R 7 42 42 0"), Some(7));
        assert_eq!(state(b"99 (sleep) Z 1 99 99"), Some('Z'));
        // A name that is not UTF-8.
        assert_eq!((state(b"5 (\xff\xfe)) D 1 5"), parent(b"5 (\xff\xfe)) D 1 5")), (Some('D'), Some(1)));
        assert_eq!((state(b"7 (sleep)"), parent(b"7 (sleep) S")), (None, None));
        assert_eq!((state(b"garbage"), parent(b"garbage")), (None, None));
    }
}
