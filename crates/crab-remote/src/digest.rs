//! SHA-256 digests of objects, packs and OCI blobs.
//!
//! The same 32 bytes as the checkpoint store's digest (`crab-store`'s `Digest.0`), so the two
//! convert without hashing again; on the wire it is written as OCI writes it, `sha256:<hex>`.

use std::fmt;
use std::str::FromStr;

use sha2::{Digest as _, Sha256};

/// A SHA-256 content digest.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Digest(pub [u8; 32]);

/// A string that is not a lower-case hex SHA-256 digest (with or without `sha256:`).
#[derive(Debug, Clone, thiserror::Error)]
#[error("{0:?} is not a sha256 digest")]
pub struct InvalidDigest(pub String);

impl Digest {
    pub fn of(data: &[u8]) -> Self {
        Digest(Sha256::digest(data).into())
    }

    pub fn to_hex(&self) -> String {
        hex::encode(self.0)
    }

    /// `sha256:<hex>`, as OCI descriptors and registries name content.
    pub fn to_oci(&self) -> String {
        format!("sha256:{}", self.to_hex())
    }

    /// Parses `sha256:<64 lower-case hex>`; any other algorithm is refused.
    pub fn from_oci(s: &str) -> Result<Self, InvalidDigest> {
        s.strip_prefix("sha256:").ok_or_else(|| InvalidDigest(s.to_owned()))?.parse()
    }
}

impl fmt::Display for Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_oci())
    }
}

impl fmt::Debug for Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_oci())
    }
}

impl FromStr for Digest {
    type Err = InvalidDigest;

    /// 64 lower-case hex digits.
    fn from_str(s: &str) -> Result<Self, InvalidDigest> {
        let invalid = || InvalidDigest(s.to_owned());
        if s.len() != 64 || s.bytes().any(|b| b.is_ascii_uppercase()) {
            return Err(invalid());
        }
        let mut out = [0u8; 32];
        hex::decode_to_slice(s, &mut out).map_err(|_| invalid())?;
        Ok(Digest(out))
    }
}

impl serde::Serialize for Digest {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_oci())
    }
}

impl<'de> serde::Deserialize<'de> for Digest {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = <String as serde::Deserialize>::deserialize(d)?;
        Digest::from_oci(&s).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn oci_form_round_trips_and_is_strict() {
        let d = Digest::of(b"hello");
        assert_eq!(d.to_oci(), "sha256:2cf24dba5fb0a30e26e83b2ac5b9e29e1b161e5c1fa7425e73043362938b9824");
        assert_eq!(Digest::from_oci(&d.to_oci()).unwrap(), d);
        assert!(Digest::from_oci(&d.to_hex()).is_err());
        assert!(Digest::from_oci(&format!("sha512:{}", d.to_hex())).is_err());
        assert!(Digest::from_oci(&d.to_oci().to_uppercase()).is_err());
        assert!(Digest::from_oci("sha256:abc").is_err());
    }
}
