//! Agent turn traces: a JSONL file with a header line, then one line per turn.
//!
//! Every field is checked while parsing, so a bad trace fails before a sandbox
//! exists, with an error that names the file, the line and the field.

use std::path::{Path, PathBuf};

use serde::Serialize;
use serde_json::{Map, Value};

#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    #[error("{file}: cannot read: {source}")]
    Read {
        file: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{file}: empty trace (no header line)")]
    Empty { file: PathBuf },
    #[error("{file}:{line}: not valid JSON: {message}")]
    Json { file: PathBuf, line: usize, message: String },
    #[error("{file}:{line}: expected a JSON object, found {found}")]
    NotAnObject { file: PathBuf, line: usize, found: &'static str },
    #[error("{file}:{line}: missing field `{field}`")]
    MissingField { file: PathBuf, line: usize, field: &'static str },
    #[error("{file}:{line}: field `{field}`: {problem}")]
    BadField { file: PathBuf, line: usize, field: &'static str, problem: String },
    #[error("{file}:{line}: turn {found} out of order (expected turn {expected})")]
    TurnOutOfOrder { file: PathBuf, line: usize, expected: u32, found: u32 },
    #[error("{file}: header says {declared} turns but the file has {found}")]
    TurnCountMismatch { file: PathBuf, declared: u32, found: u32 },
}

/// How each turn reaches the sandbox. Only `exec` traces exist today: every
/// turn is its own `bash -c` exec in the workdir.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Mode {
    Exec,
}

/// The sandbox image family a trace was recorded against.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "kind", rename_all = "kebab-case")]
pub enum TraceImage {
    Terminal,
    CodeRepair { project: String, version: String },
}

impl TraceImage {
    /// The local image reference `scripts/build-images` imports.
    pub fn reference(&self) -> String {
        match self {
            TraceImage::Terminal => "crab.local/terminal:latest".to_string(),
            TraceImage::CodeRepair { project, version } => {
                format!("crab.local/{}:latest", code_repair_image_name(project, version))
            }
        }
    }

    /// The `scripts/build-images` arguments that build this image.
    pub fn build_hint(&self) -> String {
        match self {
            TraceImage::Terminal => "scripts/build-images terminal".to_string(),
            TraceImage::CodeRepair { project, version } => {
                format!("scripts/build-images code-repair {project} {version}")
            }
        }
    }
}

/// The image name of a code-repair trace's project and version, as `scripts/build-images`
/// (`code_repair_image_name` in `scripts/lib/images.sh`) names it: lowercased, because an image
/// reference's repository must be lowercase while trace headers keep the project's own
/// spelling (`"project": "Django"`). The header's spelling stays what `build-images` is given:
/// pip needs it, and the script lowercases the same way.
pub fn code_repair_image_name(project: &str, version: &str) -> String {
    format!("code-repair-{}-{}", project.to_ascii_lowercase(), version.to_ascii_lowercase())
}

#[derive(Debug, Clone, Serialize)]
pub struct TraceHeader {
    pub trace: String,
    pub mode: Mode,
    pub workdir: String,
    pub image: TraceImage,
    pub turns: u32,
    /// Absolute container paths the oracle's fingerprint leaves out (state the trace knows to
    /// be nondeterministic or irrelevant), besides its own volatile ones.
    pub ignore: Vec<String>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Turn {
    pub turn: u32,
    pub think_s: f64,
    pub cmd: String,
    pub timeout_s: f64,
    /// As recorded by the original run; absent when the run ended on this turn.
    pub exec_s: Option<f64>,
    pub rc: Option<i32>,
}

#[derive(Debug, Clone)]
pub struct Trace {
    pub file: PathBuf,
    pub header: TraceHeader,
    pub turns: Vec<Turn>,
}

impl Trace {
    pub fn load(file: &Path) -> Result<Trace, TraceError> {
        let text =
            std::fs::read_to_string(file).map_err(|source| TraceError::Read { file: file.to_path_buf(), source })?;
        Trace::parse(file, &text)
    }

    /// Parses trace text; `file` only names the source in errors.
    pub fn parse(file: &Path, text: &str) -> Result<Trace, TraceError> {
        let mut lines =
            text.lines().enumerate().map(|(index, line)| (index + 1, line)).filter(|(_, line)| !line.trim().is_empty());
        let (header_line, header_text) = lines.next().ok_or_else(|| TraceError::Empty { file: file.to_path_buf() })?;
        let header = Fields::parse(file, header_line, header_text)?.header()?;
        let mut turns = Vec::new();
        for (line, line_text) in lines {
            let turn = Fields::parse(file, line, line_text)?.turn()?;
            let expected = turns.len() as u32 + 1;
            if turn.turn != expected {
                return Err(TraceError::TurnOutOfOrder { file: file.to_path_buf(), line, expected, found: turn.turn });
            }
            turns.push(turn);
        }
        if turns.len() as u32 != header.turns {
            return Err(TraceError::TurnCountMismatch {
                file: file.to_path_buf(),
                declared: header.turns,
                found: turns.len() as u32,
            });
        }
        Ok(Trace { file: file.to_path_buf(), header, turns })
    }
}

/// One parsed JSON object plus where it came from, for field-level errors.
struct Fields<'a> {
    file: &'a Path,
    line: usize,
    object: Map<String, Value>,
}

impl<'a> Fields<'a> {
    fn parse(file: &'a Path, line: usize, text: &str) -> Result<Fields<'a>, TraceError> {
        let value: Value = serde_json::from_str(text).map_err(|error| TraceError::Json {
            file: file.to_path_buf(),
            line,
            message: error.to_string(),
        })?;
        match value {
            Value::Object(object) => Ok(Fields { file, line, object }),
            other => Err(TraceError::NotAnObject { file: file.to_path_buf(), line, found: json_type(&other) }),
        }
    }

    fn header(&self) -> Result<TraceHeader, TraceError> {
        let trace = self.string("trace")?;
        let mode = match self.string("mode")?.as_str() {
            "exec" => Mode::Exec,
            other => {
                return Err(self.bad("mode", format!("unknown mode {other:?} (expected \"exec\")")));
            }
        };
        let workdir = self.string("workdir")?;
        if !workdir.starts_with('/') {
            return Err(self.bad("workdir", format!("{workdir:?} is not an absolute path")));
        }
        let image = match self.string("image")?.as_str() {
            "terminal" => TraceImage::Terminal,
            "code-repair" => TraceImage::CodeRepair {
                project: self.image_component("project")?,
                version: self.image_component("version")?,
            },
            other => {
                return Err(
                    self.bad("image", format!("unknown image {other:?} (expected \"terminal\" or \"code-repair\")"))
                );
            }
        };
        let turns = self.unsigned("turns")?;
        let ignore = self.optional(|fields| fields.absolute_paths("ignore"), "ignore")?.unwrap_or_default();
        Ok(TraceHeader { trace, mode, workdir, image, turns, ignore })
    }

    fn turn(&self) -> Result<Turn, TraceError> {
        let turn = self.unsigned("turn")?;
        if turn == 0 {
            return Err(self.bad("turn", "turns are numbered from 1".to_string()));
        }
        let think_s = self.non_negative("think_s")?;
        let cmd = self.string("cmd")?;
        let timeout_s = self.non_negative("timeout_s")?;
        if timeout_s == 0.0 {
            return Err(self.bad("timeout_s", "must be greater than 0".to_string()));
        }
        // Informational only; the original recorder produced small negative values.
        let exec_s = self.optional(|fields| fields.finite("exec_s"), "exec_s")?;
        let rc = self.optional(|fields| fields.integer("rc"), "rc")?;
        Ok(Turn { turn, think_s, cmd, timeout_s, exec_s, rc })
    }

    fn get(&self, field: &'static str) -> Result<&Value, TraceError> {
        self.object.get(field).ok_or_else(|| TraceError::MissingField {
            file: self.file.to_path_buf(),
            line: self.line,
            field,
        })
    }

    fn bad(&self, field: &'static str, problem: String) -> TraceError {
        TraceError::BadField { file: self.file.to_path_buf(), line: self.line, field, problem }
    }

    fn wrong_type(&self, field: &'static str, expected: &str, value: &Value) -> TraceError {
        self.bad(field, format!("expected {expected}, found {}", json_type(value)))
    }

    fn string(&self, field: &'static str) -> Result<String, TraceError> {
        match self.get(field)? {
            Value::String(text) => Ok(text.clone()),
            other => Err(self.wrong_type(field, "a string", other)),
        }
    }

    /// A project or version name that ends up in an image reference, so it
    /// must not smuggle path or reference syntax in.
    fn image_component(&self, field: &'static str) -> Result<String, TraceError> {
        let text = self.string(field)?;
        let allowed = |c: char| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_');
        if text.is_empty() || !text.chars().all(allowed) || text.starts_with('.') {
            return Err(self.bad(field, format!("{text:?} is not a plain project/version name")));
        }
        Ok(text)
    }

    fn absolute_paths(&self, field: &'static str) -> Result<Vec<String>, TraceError> {
        let value = self.get(field)?;
        let Value::Array(items) = value else { return Err(self.wrong_type(field, "an array of paths", value)) };
        items
            .iter()
            .map(|item| match item {
                Value::String(path) if path.starts_with('/') => Ok(path.clone()),
                Value::String(path) => Err(self.bad(field, format!("{path:?} is not an absolute path"))),
                other => Err(self.wrong_type(field, "an array of paths", other)),
            })
            .collect()
    }

    fn unsigned(&self, field: &'static str) -> Result<u32, TraceError> {
        let value = self.get(field)?;
        value
            .as_u64()
            .and_then(|n| u32::try_from(n).ok())
            .ok_or_else(|| self.wrong_type(field, "a non-negative integer", value))
    }

    fn integer(&self, field: &'static str) -> Result<i32, TraceError> {
        let value = self.get(field)?;
        value.as_i64().and_then(|n| i32::try_from(n).ok()).ok_or_else(|| self.wrong_type(field, "an integer", value))
    }

    fn finite(&self, field: &'static str) -> Result<f64, TraceError> {
        let value = self.get(field)?;
        match value.as_f64() {
            Some(n) if n.is_finite() => Ok(n),
            Some(n) => Err(self.bad(field, format!("{n} is not finite"))),
            None => Err(self.wrong_type(field, "a number", value)),
        }
    }

    fn non_negative(&self, field: &'static str) -> Result<f64, TraceError> {
        let n = self.finite(field)?;
        if n < 0.0 {
            return Err(self.bad(field, format!("{n} is negative")));
        }
        Ok(n)
    }

    /// Absent and `null` both mean "not recorded".
    fn optional<T>(
        &self,
        read: impl Fn(&Self) -> Result<T, TraceError>,
        field: &'static str,
    ) -> Result<Option<T>, TraceError> {
        match self.object.get(field) {
            None | Some(Value::Null) => Ok(None),
            Some(_) => read(self).map(Some),
        }
    }
}

fn json_type(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const HEADER: &str = r#"{"trace": "t1", "source": "s", "mode": "exec", "shell": "bash -c", "workdir": "/app", "image": "terminal", "turns": 2}"#;

    fn parse(text: &str) -> Result<Trace, TraceError> {
        Trace::parse(Path::new("t1.jsonl"), text)
    }

    fn with_turns(header: &str, turns: &[&str]) -> String {
        let mut text = header.to_string();
        for turn in turns {
            text.push('\n');
            text.push_str(turn);
        }
        text
    }

    #[test]
    fn parses_a_valid_trace() {
        let text = with_turns(
            HEADER,
            &[
                r#"{"turn": 1, "think_s": 0.0, "cmd": "ls", "timeout_s": 60, "exec_s": 0.02, "rc": 0}"#,
                r#"{"turn": 2, "think_s": 2.5, "cmd": "echo x > f", "timeout_s": 60}"#,
            ],
        );
        let trace = parse(&text).unwrap();
        assert_eq!(trace.header.trace, "t1");
        assert_eq!(trace.header.image, TraceImage::Terminal);
        assert_eq!(trace.header.image.reference(), "crab.local/terminal:latest");
        assert_eq!(trace.turns.len(), 2);
        assert_eq!(trace.turns[0].rc, Some(0));
        assert_eq!(trace.turns[1].exec_s, None);
        assert_eq!(trace.turns[1].cmd, "echo x > f");
    }

    #[test]
    fn code_repair_image_names_project_and_version() {
        let header = r#"{"trace": "t", "mode": "exec", "workdir": "/testbed", "image": "code-repair", "project": "marshmallow", "version": "3.0.0", "turns": 0}"#;
        let trace = parse(header).unwrap();
        assert_eq!(trace.header.image.reference(), "crab.local/code-repair-marshmallow-3.0.0:latest");
    }

    #[test]
    fn code_repair_image_name_is_lowercase_like_build_images() {
        let header = r#"{"trace": "t", "mode": "exec", "workdir": "/testbed", "image": "code-repair", "project": "Django", "version": "4.0RC1", "turns": 0}"#;
        let trace = parse(header).unwrap();
        assert_eq!(trace.header.image.reference(), "crab.local/code-repair-django-4.0rc1:latest");
        // The header's spelling is what build-images is given: it lowercases the same way.
        assert_eq!(trace.header.image.build_hint(), "scripts/build-images code-repair Django 4.0RC1");
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        let script = std::process::Command::new("bash")
            .arg("-c")
            .arg("source \"$CRAB_ROOT/scripts/lib/images.sh\" && code_repair_image_name Django 4.0RC1")
            .env("CRAB_ROOT", root)
            .env("CRAB_CACHE", "/nonexistent")
            .output()
            .unwrap();
        assert!(script.status.success(), "{}", String::from_utf8_lossy(&script.stderr));
        assert_eq!(String::from_utf8_lossy(&script.stdout).trim(), code_repair_image_name("Django", "4.0RC1"));
    }

    #[test]
    fn code_repair_without_project_names_the_field() {
        let header = r#"{"trace": "t", "mode": "exec", "workdir": "/testbed", "image": "code-repair", "version": "3.0.0", "turns": 0}"#;
        let error = parse(header).unwrap_err().to_string();
        assert_eq!(error, "t1.jsonl:1: missing field `project`");
    }

    #[test]
    fn project_with_path_syntax_is_rejected() {
        let header = r#"{"trace": "t", "mode": "exec", "workdir": "/testbed", "image": "code-repair", "project": "../x", "version": "1", "turns": 0}"#;
        let error = parse(header).unwrap_err().to_string();
        assert!(error.contains("field `project`"), "{error}");
    }

    #[test]
    fn bad_json_names_file_and_line() {
        let text = with_turns(HEADER, &[r#"{"turn": 1, "think_s": 0"#]);
        let error = parse(&text).unwrap_err().to_string();
        assert!(error.starts_with("t1.jsonl:2: not valid JSON"), "{error}");
    }

    #[test]
    fn missing_field_names_line_and_field() {
        let text = with_turns(
            HEADER,
            &[
                r#"{"turn": 1, "think_s": 0, "cmd": "ls", "timeout_s": 60}"#,
                r#"{"turn": 2, "think_s": 0, "timeout_s": 60}"#,
            ],
        );
        let error = parse(&text).unwrap_err().to_string();
        assert_eq!(error, "t1.jsonl:3: missing field `cmd`");
    }

    #[test]
    fn wrong_type_names_the_field_and_types() {
        let text = with_turns(HEADER, &[r#"{"turn": 1, "think_s": "slow", "cmd": "ls", "timeout_s": 60}"#]);
        let error = parse(&text).unwrap_err().to_string();
        assert_eq!(error, "t1.jsonl:2: field `think_s`: expected a number, found a string");
    }

    #[test]
    fn turns_out_of_order_are_rejected() {
        let text = with_turns(
            HEADER,
            &[
                r#"{"turn": 1, "think_s": 0, "cmd": "ls", "timeout_s": 60}"#,
                r#"{"turn": 3, "think_s": 0, "cmd": "ls", "timeout_s": 60}"#,
            ],
        );
        let error = parse(&text).unwrap_err().to_string();
        assert_eq!(error, "t1.jsonl:3: turn 3 out of order (expected turn 2)");
    }

    #[test]
    fn turn_count_must_match_header() {
        let text = with_turns(HEADER, &[r#"{"turn": 1, "think_s": 0, "cmd": "ls", "timeout_s": 60}"#]);
        let error = parse(&text).unwrap_err().to_string();
        assert_eq!(error, "t1.jsonl: header says 2 turns but the file has 1");
    }

    #[test]
    fn unknown_mode_and_image_are_named() {
        let mode = HEADER.replace(r#""mode": "exec""#, r#""mode": "pty""#);
        let error = parse(&mode).unwrap_err().to_string();
        assert!(error.contains("field `mode`: unknown mode \"pty\""), "{error}");
        let image = HEADER.replace(r#""image": "terminal""#, r#""image": "windows""#);
        let error = parse(&image).unwrap_err().to_string();
        assert!(error.contains("field `image`: unknown image \"windows\""), "{error}");
    }

    #[test]
    fn relative_workdir_and_zero_timeout_are_rejected() {
        let relative = HEADER.replace(r#""workdir": "/app""#, r#""workdir": "app""#);
        assert!(parse(&relative).unwrap_err().to_string().contains("field `workdir`"));
        let text = with_turns(HEADER, &[r#"{"turn": 1, "think_s": 0, "cmd": "ls", "timeout_s": 0}"#]);
        assert!(parse(&text).unwrap_err().to_string().contains("field `timeout_s`: must be greater than 0"));
    }

    #[test]
    fn null_rc_means_not_recorded_but_a_string_rc_is_an_error() {
        let ok = with_turns(
            HEADER,
            &[
                r#"{"turn": 1, "think_s": 0, "cmd": "ls", "timeout_s": 60, "rc": null}"#,
                r#"{"turn": 2, "think_s": 0, "cmd": "ls", "timeout_s": 60, "rc": 2}"#,
            ],
        );
        let trace = parse(&ok).unwrap();
        assert_eq!((trace.turns[0].rc, trace.turns[1].rc), (None, Some(2)));
        let bad = ok.replace(r#""rc": 2"#, r#""rc": "2""#);
        assert!(parse(&bad).unwrap_err().to_string().contains("field `rc`: expected an integer"));
    }

    #[test]
    fn every_shared_trace_parses() {
        // The traces the team replays must all load; skipped where they are absent.
        let root = Path::new("/work/shared/traces");
        if !root.is_dir() {
            return;
        }
        let mut count = 0;
        for family in ["tb", "swe"] {
            for entry in std::fs::read_dir(root.join(family)).unwrap() {
                let path = entry.unwrap().path();
                if path.extension().is_some_and(|ext| ext == "jsonl") {
                    Trace::load(&path).unwrap_or_else(|error| panic!("{error}"));
                    count += 1;
                }
            }
        }
        assert!(count > 0);
    }
}
