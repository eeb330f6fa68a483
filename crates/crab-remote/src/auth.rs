//! Registry credentials from a Docker client config (`~/.docker/config.json`, or a file named
//! in crab.toml, same format): `auths.<registry>.auth` is base64 of `user:password`, or
//! `username` and `password` are given apart; `identitytoken` is a bearer token. Credential
//! helpers (`credsStore`, `credHelpers`) are not run: crabd runs unattended as root, and a
//! helper that prompts or reaches a desktop keyring would hang it.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use base64::Engine as _;
use oci_client::secrets::RegistryAuth;
use serde::Deserialize;

use crate::error::{RemoteError, Result};

/// Where a registry's credentials come from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Credentials {
    /// No credentials: anonymous access.
    Anonymous,
    /// A Docker client config file; `None` is `$DOCKER_CONFIG/config.json`, else
    /// `~/.docker/config.json`. A missing default file means anonymous access; a named file
    /// that is missing is an error.
    DockerConfig(Option<PathBuf>),
}

#[derive(Deserialize)]
struct DockerConfig {
    #[serde(default)]
    auths: BTreeMap<String, AuthEntry>,
}

#[derive(Deserialize)]
struct AuthEntry {
    #[serde(default)]
    auth: Option<String>,
    #[serde(default)]
    username: Option<String>,
    #[serde(default)]
    password: Option<String>,
    #[serde(default)]
    identitytoken: Option<String>,
}

/// Bounded: a credentials file is small; anything larger is not one.
const MAX_CONFIG_BYTES: u64 = 1 << 20;

impl Credentials {
    /// The file this reads, for messages ("check <file>").
    pub fn describe(&self) -> String {
        match self {
            Credentials::Anonymous => "the registry settings (no credentials are configured)".into(),
            Credentials::DockerConfig(Some(path)) => path.display().to_string(),
            Credentials::DockerConfig(None) => {
                default_docker_config().map_or("~/.docker/config.json".into(), |p| p.display().to_string())
            }
        }
    }

    /// The credentials for `registry` (`host[:port]`).
    pub fn resolve(&self, registry: &str) -> Result<RegistryAuth> {
        let (path, required) = match self {
            Credentials::Anonymous => return Ok(RegistryAuth::Anonymous),
            Credentials::DockerConfig(Some(path)) => (path.clone(), true),
            Credentials::DockerConfig(None) => match default_docker_config() {
                Some(path) => (path, false),
                None => return Ok(RegistryAuth::Anonymous),
            },
        };
        let bad = |reason: String| RemoteError::Credentials { path: path.clone(), reason };
        let bytes = match read_bounded(&path) {
            Ok(bytes) => bytes,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound && !required => return Ok(RegistryAuth::Anonymous),
            Err(e) => return Err(bad(e.to_string())),
        };
        let config: DockerConfig =
            serde_json::from_slice(&bytes).map_err(|e| bad(format!("not a Docker client config: {e}")))?;
        let Some(entry) = config.auths.iter().find(|(key, _)| registry_of_key(key) == registry).map(|(_, e)| e) else {
            return Ok(RegistryAuth::Anonymous);
        };
        if let Some(token) = &entry.identitytoken {
            return Ok(RegistryAuth::Bearer(token.clone()));
        }
        if let (Some(user), Some(password)) = (&entry.username, &entry.password) {
            return Ok(RegistryAuth::Basic(user.clone(), password.clone()));
        }
        let Some(auth) = &entry.auth else {
            return Err(bad(format!("the entry for {registry} has neither auth nor username and password")));
        };
        let decoded = base64::engine::general_purpose::STANDARD
            .decode(auth.trim())
            .map_err(|e| bad(format!("auth of {registry} is not base64: {e}")))?;
        let decoded = String::from_utf8(decoded).map_err(|_| bad(format!("auth of {registry} is not UTF-8")))?;
        let (user, password) =
            decoded.split_once(':').ok_or_else(|| bad(format!("auth of {registry} is not user:password")))?;
        Ok(RegistryAuth::Basic(user.to_owned(), password.to_owned()))
    }
}

fn read_bounded(path: &Path) -> std::io::Result<Vec<u8>> {
    use std::io::Read;
    let mut bytes = Vec::new();
    std::fs::File::open(path)?.take(MAX_CONFIG_BYTES + 1).read_to_end(&mut bytes)?;
    if bytes.len() as u64 > MAX_CONFIG_BYTES {
        return Err(std::io::Error::other(format!("larger than {MAX_CONFIG_BYTES} bytes")));
    }
    Ok(bytes)
}

fn default_docker_config() -> Option<PathBuf> {
    if let Some(dir) = std::env::var_os("DOCKER_CONFIG") {
        return Some(PathBuf::from(dir).join("config.json"));
    }
    std::env::var_os("HOME").map(|home| PathBuf::from(home).join(".docker/config.json"))
}

/// The registry a key of `auths` names: keys may be bare (`host:port`) or URLs
/// (`https://host/v1/`), as `docker login` writes them.
fn registry_of_key(key: &str) -> &str {
    let key = key.strip_prefix("https://").or_else(|| key.strip_prefix("http://")).unwrap_or(key);
    key.split('/').next().unwrap_or(key)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(dir: &Path, json: &str) -> PathBuf {
        let path = dir.join("config.json");
        std::fs::write(&path, json).unwrap();
        path
    }

    #[test]
    fn docker_config_forms() {
        let dir = tempfile::tempdir().unwrap();
        let path = write(
            dir.path(),
            r#"{"auths":{"127.0.0.1:5000":{"auth":"Y3JhYjpzM2NyM3Q6eA=="},
                "https://reg.example/v1/":{"username":"u","password":"p"},
                "tok.example":{"identitytoken":"T"}}}"#,
        );
        let creds = Credentials::DockerConfig(Some(path.clone()));
        // The password may contain ':' (only the first one separates).
        assert_eq!(creds.resolve("127.0.0.1:5000").unwrap(), RegistryAuth::Basic("crab".into(), "s3cr3t:x".into()));
        assert_eq!(creds.resolve("reg.example").unwrap(), RegistryAuth::Basic("u".into(), "p".into()));
        assert_eq!(creds.resolve("tok.example").unwrap(), RegistryAuth::Bearer("T".into()));
        assert_eq!(creds.resolve("other:1").unwrap(), RegistryAuth::Anonymous);
    }

    #[test]
    fn bad_files_name_themselves() {
        let dir = tempfile::tempdir().unwrap();
        let missing = Credentials::DockerConfig(Some(dir.path().join("nope.json")));
        let err = missing.resolve("r").unwrap_err().to_string();
        assert!(err.contains("nope.json"), "{err}");
        let path = write(dir.path(), r#"{"auths":{"r":{"auth":"%%%"}}}"#);
        let err = Credentials::DockerConfig(Some(path.clone())).resolve("r").unwrap_err().to_string();
        assert!(err.contains("config.json") && err.contains("base64"), "{err}");
        write(dir.path(), "[1,2]");
        let err = Credentials::DockerConfig(Some(path)).resolve("r").unwrap_err().to_string();
        assert!(err.contains("not a Docker client config"), "{err}");
    }
}
