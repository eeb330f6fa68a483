//! Decoding the option messages containerd attaches to Create and Checkpoint.

use containerd_shim_protos::protobuf::Message;
use containerd_shim_protos::protobuf::well_known_types::any::Any;
use containerd_shim_protos::shim::oci;

/// Runtime options containerd sent that cannot be used; the shim answers InvalidArgument.
#[derive(Debug, thiserror::Error)]
pub enum OptionsError {
    #[error("unsupported {what} type {type_url:?} (expected {expected})")]
    UnsupportedType { what: &'static str, type_url: String, expected: String },
    #[error("{what} of type {type_name}: {detail}")]
    Undecodable { what: &'static str, type_name: String, detail: String },
}

fn undecodable<'a>(what: &'static str, type_name: &'a str) -> impl FnOnce(String) -> OptionsError + 'a {
    move |detail| OptionsError::Undecodable { what, type_name: type_name.into(), detail }
}

/// Create options, from `containerd.runc.v1.Options` (what the runc runtime
/// entry's options become) or `runtimeoptions.v1.Options` (a `ConfigPath`).
#[derive(Debug, Default, PartialEq)]
pub struct CreateOptions {
    pub binary_name: Option<String>,
    pub root: Option<String>,
    pub systemd_cgroup: bool,
    pub no_pivot_root: bool,
    pub no_new_keyring: bool,
    pub io_uid: u32,
    pub io_gid: u32,
    pub config_path: Option<std::path::PathBuf>,
}

const RUNC_OPTIONS: &[&str] = &["containerd.runc.v1.Options", "io.containerd.runc.v1.Options"];
const RUNTIME_OPTIONS: &str = "runtimeoptions.v1.Options";
const CHECKPOINT_OPTIONS: &[&str] =
    &["containerd.runc.v1.CheckpointOptions", "containerd.linux.runc.CheckpointOptions"];

/// containerd writes bare type names; protobuf's own packing adds a host
/// prefix. Compare the last path segment.
fn type_name(any: &Any) -> &str {
    any.type_url.rsplit('/').next().unwrap_or_default()
}

fn non_empty(s: String) -> Option<String> {
    (!s.is_empty()).then_some(s)
}

impl CreateOptions {
    pub fn decode(any: Option<&Any>) -> Result<Self, OptionsError> {
        let Some(any) = any.filter(|a| !a.type_url.is_empty()) else { return Ok(Self::default()) };
        let name = type_name(any);
        if RUNC_OPTIONS.contains(&name) {
            let o =
                oci::Options::parse_from_bytes(&any.value).map_err(|e| undecodable("options", name)(e.to_string()))?;
            return Ok(Self {
                binary_name: non_empty(o.binary_name),
                root: non_empty(o.root),
                systemd_cgroup: o.systemd_cgroup,
                no_pivot_root: o.no_pivot_root,
                no_new_keyring: o.no_new_keyring,
                io_uid: o.io_uid,
                io_gid: o.io_gid,
                config_path: None,
            });
        }
        if name == RUNTIME_OPTIONS {
            let config_path = runtime_options_config_path(&any.value).map_err(undecodable("options", name))?;
            return Ok(Self { config_path: config_path.map(Into::into), ..Default::default() });
        }
        Err(OptionsError::UnsupportedType {
            what: "runtime options",
            type_url: any.type_url.clone(),
            expected: format!("{} or {RUNTIME_OPTIONS}", RUNC_OPTIONS[0]),
        })
    }
}

/// `runtimeoptions.v1.Options { string type_url = 1; string config_path = 2; }`:
/// too small a message to vendor its proto, so read field 2 off the wire.
fn runtime_options_config_path(bytes: &[u8]) -> Result<Option<String>, String> {
    let mut input = containerd_shim_protos::protobuf::CodedInputStream::from_bytes(bytes);
    let mut config_path = None;
    while let Some(tag) = input.read_raw_tag_or_eof().map_err(|e| e.to_string())? {
        let (field, wire_type) = (tag >> 3, tag & 7);
        match (field, wire_type) {
            (2, 2) => config_path = non_empty(input.read_string().map_err(|e| e.to_string())?),
            (_, 2) => {
                input.read_bytes().map_err(|e| e.to_string())?;
            }
            (_, 0) => {
                input.read_uint64().map_err(|e| e.to_string())?;
            }
            _ => return Err(format!("unexpected wire type {wire_type} for field {field}")),
        }
    }
    Ok(config_path)
}

/// `runtimeoptions.v1.Options` with only `config_path` set, as (type URL, bytes): what `ctr run
/// --runtime-config-path` gives a runtime other than runc's, and what [`CreateOptions::decode`]
/// reads back.
pub fn runtime_options_with_config_path(config_path: &str) -> (String, Vec<u8>) {
    let mut bytes = Vec::with_capacity(config_path.len() + 6);
    // Field 2, wire type 2 (length-delimited), then the length as a varint.
    bytes.push((2 << 3) | 2);
    let mut len = config_path.len() as u64;
    while len >= 0x80 {
        bytes.push((len as u8 & 0x7f) | 0x80);
        len >>= 7;
    }
    bytes.push(len as u8);
    bytes.extend_from_slice(config_path.as_bytes());
    (RUNTIME_OPTIONS.to_string(), bytes)
}

/// Checkpoint options: containerd 1.6/1.7 send `containerd.linux.runc.CheckpointOptions`
/// to runtimes other than runc's own; its fields match `containerd.runc.v1.CheckpointOptions`.
pub fn checkpoint_options(any: Option<&Any>) -> Result<oci::CheckpointOptions, OptionsError> {
    let Some(any) = any.filter(|a| !a.type_url.is_empty()) else { return Ok(Default::default()) };
    let name = type_name(any);
    if !CHECKPOINT_OPTIONS.contains(&name) {
        return Err(OptionsError::UnsupportedType {
            what: "checkpoint options",
            type_url: any.type_url.clone(),
            expected: format!("one of {}", CHECKPOINT_OPTIONS.join(", ")),
        });
    }
    oci::CheckpointOptions::parse_from_bytes(&any.value)
        .map_err(|e| undecodable("checkpoint options", name)(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options_made_for_a_config_path_decode_to_it() {
        // The bytes containerd kept for `ctr run --runtime-config-path /tmp/store/cfgtest.toml`.
        let (type_url, bytes) = runtime_options_with_config_path("/tmp/store/cfgtest.toml");
        assert_eq!(
            (type_url.as_str(), bytes.as_slice()),
            ("runtimeoptions.v1.Options", &b"\x12\x17/tmp/store/cfgtest.toml"[..])
        );
        // A path of 200 bytes takes a two-byte length.
        let long = format!("/{}", "x".repeat(199));
        let (type_url, bytes) = runtime_options_with_config_path(&long);
        let got = CreateOptions::decode(Some(&any(&type_url, bytes))).unwrap();
        assert_eq!(got.config_path.as_deref(), Some(std::path::Path::new(&long)));
    }

    fn any(type_url: &str, value: Vec<u8>) -> Any {
        Any { type_url: type_url.into(), value, ..Default::default() }
    }

    #[test]
    fn runc_options_decode() {
        let o = oci::Options { binary_name: "crun".into(), systemd_cgroup: true, io_uid: 1000, ..Default::default() };
        let got = CreateOptions::decode(Some(&any("containerd.runc.v1.Options", o.write_to_bytes().unwrap()))).unwrap();
        assert_eq!(got.binary_name.as_deref(), Some("crun"));
        assert!(got.systemd_cgroup);
        assert_eq!(got.io_uid, 1000);
    }

    #[test]
    fn runtime_options_config_path_decodes() {
        // field 1 "x", field 2 "/etc/crab/crab.toml"
        let mut bytes = vec![0x0a, 1, b'x', 0x12, 19];
        bytes.extend_from_slice(b"/etc/crab/crab.toml");
        let got = CreateOptions::decode(Some(&any("runtimeoptions.v1.Options", bytes))).unwrap();
        assert_eq!(got.config_path.as_deref(), Some(std::path::Path::new("/etc/crab/crab.toml")));
    }

    #[test]
    fn unknown_options_type_is_invalid_argument_naming_it() {
        let err = CreateOptions::decode(Some(&any("example.Unknown", vec![]))).unwrap_err();
        assert!(matches!(err, OptionsError::UnsupportedType { .. }));
        assert!(err.to_string().contains("example.Unknown"), "{err}");
        let err = checkpoint_options(Some(&any("example.Other", vec![]))).unwrap_err();
        assert!(err.to_string().contains("example.Other"), "{err}");
    }

    #[test]
    fn both_checkpoint_option_types_decode() {
        let o = oci::CheckpointOptions { exit: true, open_tcp: true, image_path: "/x".into(), ..Default::default() };
        let bytes = o.write_to_bytes().unwrap();
        for t in CHECKPOINT_OPTIONS {
            let got = checkpoint_options(Some(&any(t, bytes.clone()))).unwrap();
            assert!(got.exit && got.open_tcp);
            assert_eq!(got.image_path, "/x");
        }
    }
}
