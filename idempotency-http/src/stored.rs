//! The compact binary form of a stored response, and the codec that hands it to
//! the manager untouched.
//!
//! Layout (all integers big-endian):
//!
//! ```text
//! "IDH1"                        magic and format version
//! u16 status
//! u8  flags                     bit 0: body retained, bit 1: trailers present
//! u16 header count, then per header: u16 name length, name, u32 value length, value
//!                               (the length's top bit: the value is marked
//!                               sensitive; the length is the other 31 bits)
//! if body retained:  u32 body length, body
//! if trailers:       u16 trailer count, then trailers like headers
//! ```
//!
//! Decoding checks every length against the bytes left, every name and value
//! with the `http` crate's validators and rejects trailing bytes: a corrupt or
//! foreign record is an error, never a panic.

use std::fmt;

use bytes::Bytes;
use http::header::{HeaderMap, HeaderName, HeaderValue};
use http::StatusCode;
use idempotency_core::{Codec, Error};
use serde::de::value::{BytesDeserializer, Error as ValueError};
use serde::de::{DeserializeOwned, Visitor};
use serde::ser::{Error as _, Impossible};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

const MAGIC: &[u8; 4] = b"IDH1";
const FLAG_BODY: u8 = 1;
const FLAG_TRAILERS: u8 = 2;

/// A response as the store keeps it: the bytes of a record's result written by
/// the layer. Operator tools read one back with [`decode`](Self::decode) to
/// show it (`idempotency get` prints its status, headers and body).
///
/// ```
/// use idempotency_http::StoredResponse;
/// // A record written by another codec (JSON) is not a stored response.
/// assert!(StoredResponse::decode(br#"{"id":1}"#).is_err());
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredResponse {
    pub(crate) status: StatusCode,
    pub(crate) headers: HeaderMap,
    /// `None`: the body was larger than the cap and was passed through
    /// uncached; a replay cannot reproduce it.
    pub(crate) body: Option<Bytes>,
    pub(crate) trailers: Option<HeaderMap>,
}

/// Why stored bytes could not be read back (or a response not be written).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FormatError(pub(crate) String);

impl std::error::Error for FormatError {}

impl fmt::Display for FormatError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "stored HTTP response: {}", self.0)
    }
}

fn err(msg: impl Into<String>) -> FormatError {
    FormatError(msg.into())
}

impl StoredResponse {
    /// A response whose body was not retained: only the status survives, and
    /// whatever `outcome` names it further (gRPC's final status).
    pub(crate) fn not_retained(status: StatusCode, outcome: Option<HeaderMap>) -> Self {
        StoredResponse {
            status,
            headers: HeaderMap::new(),
            body: None,
            trailers: outcome,
        }
    }

    /// The encoded length of the status and headers alone.
    pub(crate) fn head_len(headers: &HeaderMap) -> usize {
        4 + 2 + 1 + 2 + headers_len(headers)
    }

    /// Encodes into the layout above.
    ///
    /// # Errors
    /// When a count or length does not fit its field (more than 65535 headers,
    /// a header value or body over 4 GiB).
    pub(crate) fn encode(&self) -> Result<Vec<u8>, FormatError> {
        let body_len = self.body.as_ref().map_or(0, |b| 4 + b.len());
        let trailers_len = self.trailers.as_ref().map_or(0, |t| 2 + headers_len(t));
        let mut out = Vec::with_capacity(Self::head_len(&self.headers) + body_len + trailers_len);
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&self.status.as_u16().to_be_bytes());
        let mut flags = 0;
        if self.body.is_some() {
            flags |= FLAG_BODY;
        }
        if self.trailers.is_some() {
            flags |= FLAG_TRAILERS;
        }
        out.push(flags);
        put_headers(&mut out, &self.headers)?;
        if let Some(body) = &self.body {
            let len = u32::try_from(body.len()).map_err(|_| err("body over 4 GiB"))?;
            out.extend_from_slice(&len.to_be_bytes());
            out.extend_from_slice(body);
        }
        if let Some(trailers) = &self.trailers {
            put_headers(&mut out, trailers)?;
        }
        Ok(out)
    }

    /// The status code.
    pub fn status(&self) -> StatusCode {
        self.status
    }

    /// The headers, in the order they were sent (sensitive values keep
    /// their mark: [`HeaderValue::is_sensitive`]).
    pub fn headers(&self) -> &HeaderMap {
        &self.headers
    }

    /// The body; `None` when it was larger than the layer's cap and was
    /// passed through without being kept (a replay cannot reproduce it).
    pub fn body(&self) -> Option<&Bytes> {
        self.body.as_ref()
    }

    /// The trailers (a gRPC call's final status), when any were kept.
    pub fn trailers(&self) -> Option<&HeaderMap> {
        self.trailers.as_ref()
    }

    /// Decodes the bytes the layer stored (the layout in this module's
    /// source: `IDH1`, status, flags, headers, body, trailers).
    ///
    /// # Errors
    /// On any inconsistency: wrong magic (a record not written by this
    /// layer), truncation, invalid status, header name or value, unknown
    /// flags, trailing bytes.
    pub fn decode(bytes: &[u8]) -> Result<Self, FormatError> {
        let mut r = Reader { bytes, pos: 0 };
        if r.take(4)? != MAGIC {
            return Err(err("unknown format (not written by idempotency-http)"));
        }
        let status = StatusCode::from_u16(r.u16()?).map_err(|_| err("invalid status code"))?;
        let flags = r.u8()?;
        if flags & !(FLAG_BODY | FLAG_TRAILERS) != 0 {
            return Err(err(format!("unknown flags {flags:#04x}")));
        }
        let headers = r.headers()?;
        let body = if flags & FLAG_BODY != 0 {
            let len = usize::try_from(r.u32()?).map_err(|_| err("body length"))?;
            Some(Bytes::copy_from_slice(r.take(len)?))
        } else {
            None
        };
        let trailers = if flags & FLAG_TRAILERS != 0 {
            Some(r.headers()?)
        } else {
            None
        };
        if r.pos != bytes.len() {
            return Err(err(format!(
                "{} trailing bytes",
                bytes.len().saturating_sub(r.pos)
            )));
        }
        Ok(StoredResponse {
            status,
            headers,
            body,
            trailers,
        })
    }
}

fn headers_len(headers: &HeaderMap) -> usize {
    headers
        .iter()
        .map(|(n, v)| 2 + n.as_str().len() + 4 + v.len())
        .sum()
}

fn put_headers(out: &mut Vec<u8>, headers: &HeaderMap) -> Result<(), FormatError> {
    let count = u16::try_from(headers.len()).map_err(|_| err("more than 65535 headers"))?;
    out.extend_from_slice(&count.to_be_bytes());
    for (name, value) in headers {
        let name = name.as_str().as_bytes();
        let name_len = u16::try_from(name.len()).map_err(|_| err("header name too long"))?;
        let value_len = u32::try_from(value.len())
            .ok()
            .filter(|len| len & SENSITIVE == 0)
            .ok_or_else(|| err("header value too long"))?;
        let sensitive = if value.is_sensitive() { SENSITIVE } else { 0 };
        out.extend_from_slice(&name_len.to_be_bytes());
        out.extend_from_slice(name);
        out.extend_from_slice(&(value_len | sensitive).to_be_bytes());
        out.extend_from_slice(value.as_bytes());
    }
    Ok(())
}

/// The bit of a header's value length that carries the value's sensitive
/// mark (never to be indexed by HTTP/2's header compression, e.g. a
/// `Set-Cookie` the handler marked): a replay keeps it. Records written
/// before it was kept have it clear.
const SENSITIVE: u32 = 1 << 31;

/// The most header slots reserved ahead of decoding: plenty for any real
/// response, far below the most a [`HeaderMap`] can hold.
const MOST_RESERVED_HEADERS: usize = 256;

struct Reader<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], FormatError> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|end| *end <= self.bytes.len())
            .ok_or_else(|| err("truncated"))?;
        let out = &self.bytes[self.pos..end];
        self.pos = end;
        Ok(out)
    }

    fn u8(&mut self) -> Result<u8, FormatError> {
        Ok(self.take(1)?[0])
    }

    fn u16(&mut self) -> Result<u16, FormatError> {
        let b = self.take(2)?;
        Ok(u16::from_be_bytes([b[0], b[1]]))
    }

    fn u32(&mut self) -> Result<u32, FormatError> {
        let b = self.take(4)?;
        Ok(u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
    }

    fn headers(&mut self) -> Result<HeaderMap, FormatError> {
        let count = usize::from(self.u16()?);
        // Each header takes at least 6 bytes: never reserve more than the input
        // can hold, nor more than a map may (beyond which `with_capacity`
        // panics); a map grows past what was reserved as headers come.
        let room = count
            .min(self.bytes.len().saturating_sub(self.pos) / 6)
            .min(MOST_RESERVED_HEADERS);
        let mut headers = HeaderMap::with_capacity(room);
        for _ in 0..count {
            let name_len = usize::from(self.u16()?);
            let name = HeaderName::from_bytes(self.take(name_len)?)
                .map_err(|_| err("invalid header name"))?;
            let len = self.u32()?;
            let value_len = usize::try_from(len & !SENSITIVE).map_err(|_| err("header length"))?;
            let mut value = HeaderValue::from_bytes(self.take(value_len)?)
                .map_err(|_| err("invalid header value"))?;
            value.set_sensitive(len & SENSITIVE != 0);
            headers
                .try_append(name, value)
                .map_err(|_| err("too many headers"))?;
        }
        Ok(headers)
    }
}

impl Serialize for StoredResponse {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let bytes = self.encode().map_err(S::Error::custom)?;
        serializer.serialize_bytes(&bytes)
    }
}

impl<'de> Deserialize<'de> for StoredResponse {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct BytesVisitor;
        impl Visitor<'_> for BytesVisitor {
            type Value = StoredResponse;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("the bytes of a stored HTTP response")
            }
            fn visit_bytes<E: serde::de::Error>(self, v: &[u8]) -> Result<StoredResponse, E> {
                StoredResponse::decode(v).map_err(E::custom)
            }
        }
        deserializer.deserialize_bytes(BytesVisitor)
    }
}

/// A [`Codec`] that stores values which serialize as one byte string (such as
/// [`StoredResponse`]) verbatim: no JSON, no base64, no copy beyond the one the
/// store needs.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct RawBytesCodec;

impl Codec for RawBytesCodec {
    fn encode<T: Serialize + ?Sized>(&self, value: &T) -> Result<Vec<u8>, Error> {
        value.serialize(BytesOnly).map_err(|e| Error::Codec {
            source: Box::new(e),
        })
    }

    fn decode<T: DeserializeOwned>(&self, bytes: &[u8]) -> Result<T, Error> {
        T::deserialize(BytesDeserializer::<ValueError>::new(bytes)).map_err(|e| Error::Codec {
            source: Box::new(e),
        })
    }
}

/// A serializer that accepts exactly one byte string (possibly inside newtype
/// wrappers) and returns it.
struct BytesOnly;

fn only_bytes() -> ValueError {
    ValueError::custom("the HTTP response codec stores byte strings only")
}

macro_rules! reject {
    ($($method:ident($ty:ty)),* $(,)?) => {
        $(fn $method(self, _v: $ty) -> Result<Vec<u8>, ValueError> { Err(only_bytes()) })*
    };
}

impl Serializer for BytesOnly {
    type Ok = Vec<u8>;
    type Error = ValueError;
    type SerializeSeq = Impossible<Vec<u8>, ValueError>;
    type SerializeTuple = Impossible<Vec<u8>, ValueError>;
    type SerializeTupleStruct = Impossible<Vec<u8>, ValueError>;
    type SerializeTupleVariant = Impossible<Vec<u8>, ValueError>;
    type SerializeMap = Impossible<Vec<u8>, ValueError>;
    type SerializeStruct = Impossible<Vec<u8>, ValueError>;
    type SerializeStructVariant = Impossible<Vec<u8>, ValueError>;

    fn serialize_bytes(self, v: &[u8]) -> Result<Vec<u8>, ValueError> {
        Ok(v.to_vec())
    }

    reject!(
        serialize_bool(bool),
        serialize_i8(i8),
        serialize_i16(i16),
        serialize_i32(i32),
        serialize_i64(i64),
        serialize_u8(u8),
        serialize_u16(u16),
        serialize_u32(u32),
        serialize_u64(u64),
        serialize_f32(f32),
        serialize_f64(f64),
        serialize_char(char),
        serialize_str(&str),
        serialize_unit_struct(&'static str),
    );

    fn serialize_none(self) -> Result<Vec<u8>, ValueError> {
        Err(only_bytes())
    }

    fn serialize_some<T: Serialize + ?Sized>(self, _value: &T) -> Result<Vec<u8>, ValueError> {
        Err(only_bytes())
    }

    fn serialize_unit(self) -> Result<Vec<u8>, ValueError> {
        Err(only_bytes())
    }

    fn serialize_unit_variant(
        self,
        _name: &'static str,
        _index: u32,
        _variant: &'static str,
    ) -> Result<Vec<u8>, ValueError> {
        Err(only_bytes())
    }

    fn serialize_newtype_struct<T: Serialize + ?Sized>(
        self,
        _name: &'static str,
        value: &T,
    ) -> Result<Vec<u8>, ValueError> {
        value.serialize(self)
    }

    fn serialize_newtype_variant<T: Serialize + ?Sized>(
        self,
        _name: &'static str,
        _index: u32,
        _variant: &'static str,
        _value: &T,
    ) -> Result<Vec<u8>, ValueError> {
        Err(only_bytes())
    }

    fn serialize_seq(self, _len: Option<usize>) -> Result<Self::SerializeSeq, ValueError> {
        Err(only_bytes())
    }

    fn serialize_tuple(self, _len: usize) -> Result<Self::SerializeTuple, ValueError> {
        Err(only_bytes())
    }

    fn serialize_tuple_struct(
        self,
        _name: &'static str,
        _len: usize,
    ) -> Result<Self::SerializeTupleStruct, ValueError> {
        Err(only_bytes())
    }

    fn serialize_tuple_variant(
        self,
        _name: &'static str,
        _index: u32,
        _variant: &'static str,
        _len: usize,
    ) -> Result<Self::SerializeTupleVariant, ValueError> {
        Err(only_bytes())
    }

    fn serialize_map(self, _len: Option<usize>) -> Result<Self::SerializeMap, ValueError> {
        Err(only_bytes())
    }

    fn serialize_struct(
        self,
        _name: &'static str,
        _len: usize,
    ) -> Result<Self::SerializeStruct, ValueError> {
        Err(only_bytes())
    }

    fn serialize_struct_variant(
        self,
        _name: &'static str,
        _index: u32,
        _variant: &'static str,
        _len: usize,
    ) -> Result<Self::SerializeStructVariant, ValueError> {
        Err(only_bytes())
    }

    fn is_human_readable(&self) -> bool {
        false
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;

    fn sample() -> StoredResponse {
        let mut headers = HeaderMap::new();
        headers.insert("content-type", HeaderValue::from_static("application/json"));
        headers.append("x-multi", HeaderValue::from_static("a"));
        headers.append("x-multi", HeaderValue::from_static("b"));
        headers.insert(
            "x-binary",
            HeaderValue::from_bytes(b"caf\xe9 \x80\xff").unwrap(),
        );
        let mut trailers = HeaderMap::new();
        trailers.insert("grpc-status", HeaderValue::from_static("0"));
        StoredResponse {
            status: StatusCode::CREATED,
            headers,
            body: Some(Bytes::from_static(b"{\"id\":1}\0\xff binary")),
            trailers: Some(trailers),
        }
    }

    #[test]
    fn round_trips_every_part() {
        for stored in [
            sample(),
            StoredResponse::not_retained(StatusCode::OK, None),
            StoredResponse {
                body: Some(Bytes::new()),
                trailers: None,
                ..sample()
            },
        ] {
            let bytes = stored.encode().unwrap();
            assert_eq!(StoredResponse::decode(&bytes).unwrap(), stored);
            // Through the codec the manager uses.
            let via_codec = RawBytesCodec.encode(&stored).unwrap();
            assert_eq!(via_codec, bytes);
            let back: StoredResponse = RawBytesCodec.decode(&via_codec).unwrap();
            assert_eq!(back, stored);
        }
    }

    #[test]
    fn a_sensitive_mark_is_replayed_and_old_records_have_none() {
        let mut headers = HeaderMap::new();
        let mut cookie = HeaderValue::from_static("session=secret");
        cookie.set_sensitive(true);
        headers.insert("set-cookie", cookie);
        headers.insert("content-type", HeaderValue::from_static("text/plain"));
        let stored = StoredResponse {
            headers,
            ..StoredResponse::not_retained(StatusCode::OK, None)
        };
        let bytes = stored.encode().unwrap();
        let back = StoredResponse::decode(&bytes).unwrap();
        assert_eq!(back, stored);
        assert!(back.headers["set-cookie"].is_sensitive());
        assert!(!back.headers["content-type"].is_sensitive());
        // A record written before the mark was kept: the same bytes with
        // every length's top bit clear.
        let mut old = bytes.clone();
        let at = bytes
            .windows(b"set-cookie".len())
            .position(|w| w == b"set-cookie")
            .unwrap()
            + b"set-cookie".len();
        old[at] &= 0x7f;
        let back = StoredResponse::decode(&old).unwrap();
        assert_eq!(back, stored);
        assert!(!back.headers["set-cookie"].is_sensitive());
    }

    #[test]
    fn empty_body_differs_from_no_body() {
        let empty = StoredResponse {
            body: Some(Bytes::new()),
            ..StoredResponse::not_retained(StatusCode::OK, None)
        };
        let none = StoredResponse::not_retained(StatusCode::OK, None);
        assert_ne!(empty.encode().unwrap(), none.encode().unwrap());
        assert_eq!(
            StoredResponse::decode(&none.encode().unwrap())
                .unwrap()
                .body,
            None
        );
    }

    #[test]
    fn every_truncation_and_corruption_is_an_error_not_a_panic() {
        let bytes = sample().encode().unwrap();
        for len in 0..bytes.len() {
            assert!(
                StoredResponse::decode(&bytes[..len]).is_err(),
                "truncated at {len}"
            );
        }
        let mut trailing = bytes.clone();
        trailing.push(0);
        assert!(StoredResponse::decode(&trailing).is_err());
        // Flip every byte in turn: decoding may succeed (a changed body byte is
        // still a body) but must never panic.
        for i in 0..bytes.len() {
            for v in [0x00, 0xff, 0x7f, 0x0a] {
                let mut corrupt = bytes.clone();
                corrupt[i] = v;
                let _ = StoredResponse::decode(&corrupt);
            }
        }
        // Huge declared lengths do not allocate or panic.
        let mut huge = b"IDH1\x00\xc8\x01\xff\xff".to_vec();
        huge.extend_from_slice(&[0xff; 8]);
        assert!(StoredResponse::decode(&huge).is_err());
        assert!(StoredResponse::decode(b"IDH1\x03\xe8\x00\x00\x00").is_err()); // status 1000
        assert!(StoredResponse::decode(b"IDH1\x00\xc8\x80\x00\x00").is_err()); // unknown flag
        assert!(StoredResponse::decode(br#"{"json":"from another codec"}"#).is_err());
    }

    #[test]
    fn many_headers_round_trip_or_are_refused_never_a_panic() {
        // Tens of thousands of values of one name: more than a map may
        // reserve at once, yet a valid response, so it comes back whole.
        let mut headers = HeaderMap::new();
        for i in 0..30_000u32 {
            headers.append("x-many", HeaderValue::from(i));
        }
        let many = StoredResponse {
            headers,
            ..StoredResponse::not_retained(StatusCode::OK, None)
        };
        let bytes = many.encode().unwrap();
        assert_eq!(StoredResponse::decode(&bytes).unwrap(), many);

        // A record declaring more distinct names than a map can hold (only a
        // corrupt or foreign one can): an error.
        let count: u16 = 40_000;
        let mut corrupt = b"IDH1\x00\xc8\x00".to_vec();
        corrupt.extend_from_slice(&count.to_be_bytes());
        for i in 0..count {
            let name = format!("h{i}");
            corrupt.extend_from_slice(&u16::try_from(name.len()).unwrap().to_be_bytes());
            corrupt.extend_from_slice(name.as_bytes());
            corrupt.extend_from_slice(&0u32.to_be_bytes());
        }
        let refused = StoredResponse::decode(&corrupt).unwrap_err();
        assert!(
            refused.to_string().contains("too many headers"),
            "{refused}"
        );
    }

    #[test]
    fn codec_rejects_values_that_are_not_bytes() {
        assert!(RawBytesCodec.encode(&42).is_err());
        assert!(RawBytesCodec.encode("text").is_err());
        assert!(RawBytesCodec.decode::<StoredResponse>(b"").is_err());
        assert!(matches!(
            RawBytesCodec.decode::<StoredResponse>(b"garbage"),
            Err(Error::Codec { .. })
        ));
    }

    #[test]
    fn head_len_matches_the_encoding() {
        let s = sample();
        let head_only = StoredResponse {
            body: None,
            trailers: None,
            ..s
        };
        assert_eq!(
            head_only.encode().unwrap().len(),
            StoredResponse::head_len(&head_only.headers)
        );
    }
}
