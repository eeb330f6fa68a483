// The digest of source files that define a wire format (included by build.rs as well as
// compiled into the library, so the inspector's build script and crab-node's runtime hash
// the same way). Plain comments only: `include!` takes no inner doc comments.

/// SHA-256 over `(name, text)` pairs, first 16 hex digits. Of a Rust file only the code counts:
/// its unit tests (from `#[cfg(test)]` on) and its comment lines do not change a wire format.
pub fn source_digest(files: &[(&str, &str)]) -> String {
    use sha2::{Digest, Sha256};
    let mut hasher = Sha256::new();
    for (name, text) in files {
        let code = if name.ends_with(".rs") {
            text.lines()
                .take_while(|line| line.trim() != "#[cfg(test)]")
                .filter(|line| !line.trim_start().starts_with("//"))
                .collect::<Vec<_>>()
                .join("\n")
        } else {
            text.to_string()
        };
        hasher.update(name.as_bytes());
        hasher.update([0]);
        hasher.update(code.as_bytes());
        hasher.update([0]);
    }
    hasher.finalize().iter().take(8).map(|b| format!("{b:02x}")).collect()
}
