//! Making turn output comparable across runs that happen at different times.
//!
//! The reference runs and a recovered run cannot happen at the same time of
//! day, so output that prints the clock (`ls -l` times, `date`, `git log`,
//! `stat`, log lines) differs for reasons that have nothing to do with the
//! sandbox's state. The oracle compares output with such stamps replaced by
//! a placeholder and says which turns only matched that way. Recognised:
//!
//! | form | example | placeholder |
//! |---|---|---|
//! | `date`, `git log`, ctime | `Sun Nov 29 19:11:03 UTC 2026`, `Sun Nov 29 19:11:03 2026 +0000` | `<date>` |
//! | RFC 2822 / HTTP | `Sun, 29 Nov 2026 19:11:03 +0000`, `... GMT` | `<date>` |
//! | common log format | `29/Nov/2026:19:11:03 +0000` | `<date>` |
//! | ISO 8601 (`date -Is`, `stat`, `--full-time`, Python) | `2026-11-29T19:11:03+00:00`, `2026-11-29 19:11:03.309665675 +0000` | `<datetime>` |
//! | `ls -l` month-day-time | `Nov 29 19:11`, `Nov 29  2025` | `<mtime>` |
//! | time of day | `19:11:03`, `19:11:03.458` | `<time>` |
//! | elapsed time of a test run (pytest, unittest), `time` | `5 passed in 0.12s`, `Ran 3 tests in 0.002s`, `real 0m0.004s` | `in <elapsed>`, `real <elapsed>` |
//! | bash's input line in its messages | `bash: line 12: foo: command not found` | `bash: line <n>:` |
//!
//! Elapsed times were once left to the two reference runs, like other output
//! that varies: a node-loss evaluation then judged three recoveries wrong only
//! because pytest's `in 0.05s` differed from `in 0.06s`, which both reference
//! runs had happened to print. A duration is the clock read twice, no more the
//! sandbox's state than the time of day; the counts beside it stay compared.
//!
//! bash names the line of its input a message is about, and a session's line count is the
//! lines it was fed: crab asks a stdin session for its state with one line of its own per
//! turn (see crab-engine's `shell` module), so under crab the count runs ahead of a run
//! without it. What the message says is compared; its line number is not.
//!
//! Dates without a time (`2026-11-29`) are left alone: they change once a
//! day, and two reference runs on different days show such a turn as
//! nondeterministic. Minute-resolution times outside `ls -l` (ps's STIME)
//! are left to the spacing of the reference runs.
//!
//! Separately, stderr may be compared without its line order: the members of
//! a pipeline write to the same stderr concurrently, so the order of their
//! messages is the scheduler's choice, not the sandbox's state.

use std::sync::LazyLock;

use regex::Regex;

const DAY: &str = "(?:Mon|Tue|Wed|Thu|Fri|Sat|Sun)";
const MONTH: &str = "(?:Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec)";

/// Patterns in the order they are applied: the longer forms first, so a
/// `date` line becomes one `<date>`, not a month-day and a `<time>`.
static STAMPS: LazyLock<Vec<(Regex, &'static str)>> = LazyLock::new(|| {
    let hms = r"\d{2}:\d{2}:\d{2}(?:[.,]\d+)?";
    let zone = r"(?:[A-Z]{2,5}|[+-]\d{2}:?\d{2})";
    let patterns = [
        // date(1), ctime, git log: weekday month day time [zone] year [offset]
        (format!(r"\b{DAY} {MONTH} [ \d]\d {hms}(?: {zone})? \d{{4}}(?: [+-]\d{{4}})?"), "<date>"),
        // RFC 2822 (date -R, mail) and HTTP (curl -I): weekday, day month year time zone
        (format!(r"\b{DAY}, \d{{1,2}} {MONTH} \d{{4}} {hms}(?: {zone})?"), "<date>"),
        // common log format (nginx, apache): day/month/year:time offset
        (format!(r"\b\d{{2}}/{MONTH}/\d{{4}}:{hms}(?: [+-]\d{{4}})?"), "<date>"),
        // ISO 8601 with a time, T or space separated, optional zone
        (
            r"\b\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}(?::\d{2}(?:[.,]\d+)?)?(?:Z|[+-]\d{2}:?\d{2}| [+-]\d{4})?".to_string(),
            "<datetime>",
        ),
        // ls -l: month, day, then HH:MM (this year) or a year (older files)
        (format!(r"\b{MONTH} [ \d]\d (?:\d{{2}}:\d{{2}}| \d{{4}})\b"), "<mtime>"),
        // any other time of day with seconds
        (format!(r"\b{hms}\b"), "<time>"),
        // a test run's elapsed time: pytest's summary, unittest's "Ran N tests in 0.002s"
        (r"\bin \d+(?:\.\d+)?s\b".to_string(), "in <elapsed>"),
        // the shell's `time`: real, user and sys
        (r"(?m)^(real|user|sys)([ \t]+)\d+m\d+[.,]\d+s$".to_string(), "$1$2<elapsed>"),
        // bash's messages name the line of its input (see the module's documentation)
        (r"\bbash: line \d+:".to_string(), "bash: line <n>:"),
    ];
    patterns
        .into_iter()
        .map(|(pattern, placeholder)| (Regex::new(&pattern).expect("stamp patterns are valid"), placeholder))
        .collect()
});

/// Output with its wall-clock stamps replaced.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Normalised {
    pub text: String,
    /// How many stamps were replaced.
    pub stamps: usize,
}

/// Replaces every wall-clock stamp in `output` (read as UTF-8, invalid bytes
/// replaced: only the comparison uses the text, the raw digests stay).
pub fn wall_clock(output: &[u8]) -> Normalised {
    let mut text = String::from_utf8_lossy(output).into_owned();
    let mut stamps = 0;
    for (pattern, placeholder) in STAMPS.iter() {
        let found = pattern.find_iter(&text).count();
        if found > 0 {
            stamps += found;
            text = pattern.replace_all(&text, *placeholder).into_owned();
        }
    }
    Normalised { text, stamps }
}

/// The lines of `text` in sorted order: equal for outputs that hold the same
/// lines in any order.
pub fn lines_in_any_order(text: &str) -> Vec<&str> {
    let mut lines: Vec<&str> = text.lines().collect();
    lines.sort_unstable();
    lines
}

/// apt's progress lines (`Get:3 file:/... Packages`, `Ign:1 http://... InRelease`, `Hit:`,
/// `Err:`) come in the order its parallel fetches end, numbered in that order: each block of
/// them, numbers left out, in sorted order. `apt update` with a reachable and an unreachable
/// source printed them in another order in two runs of three.
pub fn apt_progress_in_any_order(text: &str) -> Vec<String> {
    static PROGRESS: LazyLock<Regex> =
        LazyLock::new(|| Regex::new(r"^(Get|Hit|Ign|Err):[0-9]+ (.*)$").expect("a valid pattern"));
    let mut lines = Vec::new();
    let mut block: Vec<String> = Vec::new();
    for line in text.lines() {
        match PROGRESS.captures(line) {
            Some(fields) => block.push(format!("{} {}", &fields[1], &fields[2])),
            None => {
                block.sort_unstable();
                lines.append(&mut block);
                lines.push(line.to_string());
            }
        }
    }
    block.sort_unstable();
    lines.append(&mut block);
    lines
}

/// The first line where two outputs differ, for reports: 1-based line number
/// and both lines (empty past the end), shortened to `width` characters.
pub fn first_difference(expected: &str, got: &str, width: usize) -> Option<(usize, String, String)> {
    let mut expected_lines = expected.lines();
    let mut got_lines = got.lines();
    let shorten = |line: Option<&str>| line.unwrap_or("").chars().take(width).collect::<String>();
    for number in 1.. {
        match (expected_lines.next(), got_lines.next()) {
            (None, None) => return None,
            (a, b) if a != b => return Some((number, shorten(a), shorten(b))),
            _ => {}
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn normalised(line: &str) -> (String, usize) {
        let result = wall_clock(line.as_bytes());
        (result.text, result.stamps)
    }

    // Every line below was printed in the `terminal` image by a command the
    // traces run (ls -la, date, git log, stat, python3, curl -I, nginx logs).
    #[test]
    fn ls_long_listing_times_become_one_placeholder() {
        assert_eq!(
            normalised("drwxr-xr-x 1 root root 4096 Nov 29 19:11 ."),
            ("drwxr-xr-x 1 root root 4096 <mtime> .".to_string(), 1)
        );
        assert_eq!(
            normalised("-rw-r--r-- 1 root root    0 Nov  9 19:11 x"),
            ("-rw-r--r-- 1 root root    0 <mtime> x".to_string(), 1)
        );
        // Files older than six months show the year instead of the time.
        assert_eq!(
            normalised("-rw-r--r-- 1 root root  220 Apr 23  2023 .bash_logout"),
            ("-rw-r--r-- 1 root root  220 <mtime> .bash_logout".to_string(), 1)
        );
        assert_eq!(
            normalised("drwxr-xr-x 1 root root 4096 2026-11-29 19:11:03.309665675 +0000 ."),
            ("drwxr-xr-x 1 root root 4096 <datetime> .".to_string(), 1)
        );
    }

    #[test]
    fn date_and_git_log_lines_become_one_placeholder() {
        assert_eq!(normalised("Sun Nov 29 19:11:03 UTC 2026\n"), ("<date>\n".to_string(), 1));
        assert_eq!(normalised("Date:   Sun Nov 29 19:11:03 2026 +0000"), ("Date:   <date>".to_string(), 1));
        assert_eq!(normalised("Sun, 29 Nov 2026 19:11:03 +0000"), ("<date>".to_string(), 1));
        assert_eq!(normalised("Date: Sun, 29 Nov 2026 19:11:03 GMT\r"), ("Date: <date>\r".to_string(), 1));
        assert_eq!(normalised("Mon Dec  1 09:05:00 UTC 2026"), ("<date>".to_string(), 1));
        assert_eq!(
            normalised(r#"127.0.0.1 - - [29/Nov/2026:19:11:03 +0000] "GET / HTTP/1.1" 200 615"#),
            (r#"127.0.0.1 - - [<date>] "GET / HTTP/1.1" 200 615"#.to_string(), 1)
        );
    }

    #[test]
    fn iso_8601_stamps_in_their_common_spellings() {
        assert_eq!(normalised("2026-11-29T19:11:03+00:00"), ("<datetime>".to_string(), 1));
        assert_eq!(normalised("2026-11-29T19:11:03.123Z done"), ("<datetime> done".to_string(), 1));
        assert_eq!(normalised("2026-11-29 19:11:03 +0000"), ("<datetime>".to_string(), 1));
        assert_eq!(normalised("Modify: 2026-11-29 19:11:03.309665675 +0000"), ("Modify: <datetime>".to_string(), 1));
        assert_eq!(normalised("2026-11-29 19:11:03.458559"), ("<datetime>".to_string(), 1));
        assert_eq!(
            normalised("2026-11-29 19:11:03,120 INFO worker started"),
            ("<datetime> INFO worker started".to_string(), 1)
        );
    }

    #[test]
    fn bare_times_of_day_with_seconds() {
        assert_eq!(
            normalised(" 19:11:03 up  5:51,  0 user,  load average: 3.38, 3.28, 2.84"),
            (" <time> up  5:51,  0 user,  load average: 3.38, 3.28, 2.84".to_string(), 1)
        );
        assert_eq!(normalised("[19:11:03.458] ready"), ("[<time>] ready".to_string(), 1));
    }

    #[test]
    fn output_without_stamps_is_unchanged() {
        for line in [
            "bash: --include=*.json: command not found",
            "Usage: grep [OPTION]... PATTERNS [FILE]...",
            "total 8",
            "commit 291f193aad7ad806a813b3d229fd5a9c411cbf8b",
            "version 2.3.0 released 2026-11-29",
            "============================== 5 passed ===============================",
            "retry in 5 seconds",
            "tcp   LISTEN 0  511  0.0.0.0:80  0.0.0.0:*",
            "ratio 12:34 and 1:2:3",
            "November 29 was a Sunday",
        ] {
            assert_eq!(normalised(line), (line.to_string(), 0), "{line}");
        }
    }

    #[test]
    fn bashs_input_line_in_its_messages_becomes_a_placeholder() {
        assert_eq!(
            normalised("bash: line 12: foo: command not found"),
            ("bash: line <n>: foo: command not found".to_string(), 1)
        );
        assert_eq!(
            normalised("bash: line 3: /tmp/x: No such file or directory").0,
            normalised("bash: line 8: /tmp/x: No such file or directory").0
        );
        // The message itself is still compared, and so is a line number that is not bash's.
        assert_ne!(normalised("bash: line 3: a: not found").0, normalised("bash: line 3: b: not found").0);
        assert_eq!(normalised("error at line 3: x").1, 0);
    }

    #[test]
    fn elapsed_times_of_test_runs_and_time_become_a_placeholder() {
        assert_eq!(
            normalised("================= 1 passed, 224 deselected, 1 warning in 0.06s ================="),
            ("================= 1 passed, 224 deselected, 1 warning in <elapsed> =================".to_string(), 1)
        );
        assert_eq!(normalised("Ran 3 tests in 0.002s"), ("Ran 3 tests in <elapsed>".to_string(), 1));
        assert_eq!(normalised("26 passed in 12s"), ("26 passed in <elapsed>".to_string(), 1));
        assert_eq!(
            wall_clock(b"\nreal\t0m0.004s\nuser\t0m0.001s\nsys\t0m0.000s\n").text,
            "\nreal\t<elapsed>\nuser\t<elapsed>\nsys\t<elapsed>\n"
        );
        // The counts beside a duration are still compared.
        assert_ne!(normalised("2 passed in 0.05s").0, normalised("1 passed, 1 failed in 0.06s").0);
        assert_eq!(normalised("1 passed in 0.05s").0, normalised("1 passed in 0.06s").0);
    }

    #[test]
    fn every_stamp_of_a_listing_is_counted() {
        let listing = "total 8\n\
            drwxr-xr-x 1 root root 4096 Nov 29 19:11 .\n\
            drwxr-xr-x 1 root root 4096 Nov 29 19:10 ..\n\
            -rw-r--r-- 1 root root    0 Nov 29 19:11 x\n";
        let result = wall_clock(listing.as_bytes());
        assert_eq!(result.stamps, 3);
        // Two listings taken a minute apart compare equal.
        assert_eq!(wall_clock(listing.replace("19:1", "20:2").as_bytes()), result);
    }

    #[test]
    fn invalid_utf8_does_not_stop_normalising() {
        let result = wall_clock(b"\xff\xfe Sun Nov 29 19:11:03 UTC 2026");
        assert_eq!(result.text, "\u{fffd}\u{fffd} <date>");
    }

    #[test]
    fn stderr_of_a_pipeline_in_another_order_has_the_same_lines() {
        // Turn 15 of tb-sanitize-git-repo.hard: bash and grep report errors
        // at once, so the lines come in any of three orders.
        let usual = "bash: line 2: --include=*.json: command not found\n\
            Usage: grep [OPTION]... PATTERNS [FILE]...\n\
            Try 'grep --help' for more information.\n\
            bash: line 3: (tokenizer|tokenized|num_tokens|<your-): command not found\n";
        let raced = "Usage: grep [OPTION]... PATTERNS [FILE]...\n\
            bash: line 2: --include=*.json: command not found\n\
            Try 'grep --help' for more information.\n\
            bash: line 3: (tokenizer|tokenized|num_tokens|<your-): command not found\n";
        assert_ne!(usual, raced);
        assert_eq!(lines_in_any_order(usual), lines_in_any_order(raced));
        // A missing or extra line still differs.
        let fewer = raced.replacen("Try 'grep --help' for more information.\n", "", 1);
        assert_ne!(lines_in_any_order(usual), lines_in_any_order(&fewer));
        let doubled = format!("{raced}Try 'grep --help' for more information.\n");
        assert_ne!(lines_in_any_order(usual), lines_in_any_order(&doubled));
    }

    #[test]
    fn first_difference_names_the_line() {
        assert_eq!(first_difference("a\nb\nc\n", "a\nb\nc\n", 80), None);
        assert_eq!(first_difference("a\nb\nc\n", "a\nX\nc\n", 80), Some((2, "b".to_string(), "X".to_string())));
        assert_eq!(first_difference("a\n", "a\nmore\n", 2), Some((2, String::new(), "mo".to_string())));
    }
}
