//! Paths on the wire: a UTF-8 path is a JSON string, any other is its bytes
//! (an array of numbers), so that no path is altered on the way.

use std::ffi::OsString;
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::path::PathBuf;

use serde::{Deserialize, Deserializer, Serializer};

// serde's `with` hands over the field's own type.
#[allow(clippy::ptr_arg)]
pub fn serialize<S: Serializer>(path: &PathBuf, serializer: S) -> Result<S::Ok, S::Error> {
    match path.to_str() {
        Some(text) => serializer.serialize_str(text),
        None => serializer.serialize_bytes(path.as_os_str().as_bytes()),
    }
}

#[derive(Deserialize)]
#[serde(untagged)]
enum Wire {
    Text(String),
    Bytes(Vec<u8>),
}

pub fn deserialize<'de, D: Deserializer<'de>>(deserializer: D) -> Result<PathBuf, D::Error> {
    Ok(match Wire::deserialize(deserializer)? {
        Wire::Text(text) => PathBuf::from(text),
        Wire::Bytes(bytes) => PathBuf::from(OsString::from_vec(bytes)),
    })
}
