//! How handler results become the bytes a record caches.

use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::error::Error;

/// Turns handler results into bytes and back. Implement it to store results in
/// another format (bincode, protobuf, …); [`JsonCodec`] is the default.
pub trait Codec: Send + Sync + std::fmt::Debug + 'static {
    /// Serializes a result.
    ///
    /// # Errors
    /// [`Error::Codec`] when the value cannot be serialized.
    fn encode<T: Serialize + ?Sized>(&self, value: &T) -> Result<Vec<u8>, Error>;

    /// Deserializes a cached result.
    ///
    /// # Errors
    /// [`Error::Codec`] when the bytes are not a valid `T` (for example after the
    /// result type changed between deployments).
    fn decode<T: DeserializeOwned>(&self, bytes: &[u8]) -> Result<T, Error>;
}

/// JSON through `serde_json` (readable in the store, tolerant of added fields).
#[derive(Debug, Clone, Copy, Default)]
pub struct JsonCodec;

impl Codec for JsonCodec {
    fn encode<T: Serialize + ?Sized>(&self, value: &T) -> Result<Vec<u8>, Error> {
        serde_json::to_vec(value).map_err(|e| Error::Codec { source: e.into() })
    }

    fn decode<T: DeserializeOwned>(&self, bytes: &[u8]) -> Result<T, Error> {
        serde_json::from_slice(bytes).map_err(|e| Error::Codec { source: e.into() })
    }
}
