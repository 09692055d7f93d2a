//! The stored record format (version 1): one binary-safe Redis string.
//!
//! ```text
//! offset len  field
//!      0   1  format version (1)
//!      1   1  status: b'P' processing, b'C' completed, b'F' failed
//!      2   4  attempt            (u32, big-endian)
//!      6   8  created_at         (u64 ms since the epoch, big-endian)
//!     14  16  owner token        (u128, big-endian)
//!     30   8  lease_until        (u64 ms, big-endian)
//!     38   8  expires_at         (u64 ms, big-endian)
//!     46   8  updated_at         (u64 ms, big-endian)
//!     54   1  flags: bit 0 fingerprint, bit 1 result, bit 2 error,
//!                bit 3 retryable (only on a failed record)
//!     55  32  fingerprint        (only when bit 0 is set)
//!      …   …  result or error    (the rest of the string, when bit 1 or 2 is set)
//! ```
//!
//! The Lua scripts read the same offsets (1-based there); `attempt` and
//! `created_at` are adjacent so a takeover splices both from the old record in one
//! substring. Timestamps are compared in Lua as (high, low) 32-bit halves, so they
//! stay exact over the whole `u64` range.
//!
//! Bit 3 (`retryable`) was added without a new format version: earlier
//! versions of this crate never set it, so every record they wrote decodes
//! unchanged, as not retryable (a `Failed` record written before the bit
//! existed is never taken over; it expires with its TTL). Readers of earlier
//! versions do not know the bit and report a record carrying it (only a
//! retryable `Failed` one) as corrupt.

use idempotency_core::{Fingerprint, OwnerToken, Record, Status, Timestamp};

/// The format version written in byte 0.
pub(crate) const FORMAT_VERSION: u8 = 1;
/// Bytes before the optional fingerprint.
pub(crate) const HEADER_LEN: usize = 55;
/// Bytes of the fingerprint, when present.
pub(crate) const FINGERPRINT_LEN: usize = 32;

const FLAG_FINGERPRINT: u8 = 1;
/// A result follows (the `finish` script adds the value flags it is given to
/// the stored fingerprint bit).
pub(crate) const FLAG_RESULT: u8 = 2;
/// An error follows.
pub(crate) const FLAG_ERROR: u8 = 4;
/// A `Failed` record that a later `reserve` with `retry_failed` may take over.
/// The scripts test it as `math.floor(flags / 8) % 2`.
pub(crate) const FLAG_RETRYABLE: u8 = 8;

/// The fixed part of an encoded record (header and fingerprint), built on the
/// stack: a reservation is exactly this, so it goes into the command without a
/// heap allocation.
pub(crate) struct Head {
    buf: [u8; HEADER_LEN + FINGERPRINT_LEN],
    len: usize,
}

impl Head {
    pub(crate) fn as_bytes(&self) -> &[u8] {
        &self.buf[..self.len]
    }
}

/// The header and fingerprint of `record`; its result or error (if any) follows
/// them in the stored string (see [`encode`]).
pub(crate) fn head(record: &Record) -> Head {
    let mut buf = [0u8; HEADER_LEN + FINGERPRINT_LEN];
    buf[0] = FORMAT_VERSION;
    buf[1] = record.status.code();
    buf[2..6].copy_from_slice(&record.attempt.to_be_bytes());
    buf[6..14].copy_from_slice(&record.created_at.as_millis().to_be_bytes());
    buf[14..30].copy_from_slice(&record.owner.to_bytes());
    buf[30..38].copy_from_slice(&record.lease_until.as_millis().to_be_bytes());
    buf[38..46].copy_from_slice(&record.expires_at.as_millis().to_be_bytes());
    buf[46..54].copy_from_slice(&record.updated_at.as_millis().to_be_bytes());
    let mut flags = 0;
    if record.fingerprint.is_some() {
        flags |= FLAG_FINGERPRINT;
    }
    if record.result.is_some() {
        flags |= FLAG_RESULT;
    } else if record.error.is_some() {
        flags |= FLAG_ERROR;
    }
    if record.retryable && record.status == Status::Failed {
        flags |= FLAG_RETRYABLE;
    }
    buf[54] = flags;
    let len = match &record.fingerprint {
        Some(fp) => {
            buf[HEADER_LEN..].copy_from_slice(fp.as_bytes());
            HEADER_LEN + FINGERPRINT_LEN
        }
        None => HEADER_LEN,
    };
    Head { buf, len }
}

/// Encodes a record. The store never writes a record carrying both a result and
/// an error; should one be given, only the result is kept.
#[cfg(test)]
pub(crate) fn encode(record: &Record) -> Vec<u8> {
    let payload = record.result.as_deref().or(record.error.as_deref());
    let head = head(record);
    let mut out = Vec::with_capacity(head.len + payload.map_or(0, <[u8]>::len));
    out.extend_from_slice(head.as_bytes());
    if let Some(p) = payload {
        out.extend_from_slice(p);
    }
    out
}

/// Decodes a stored record; the error says what does not parse.
#[cfg(test)]
pub(crate) fn decode(bytes: &[u8]) -> Result<Record, String> {
    let (mut record, payload_at) = decode_fixed(bytes)?;
    for payload in [&mut record.result, &mut record.error]
        .into_iter()
        .flatten()
    {
        payload.extend_from_slice(&bytes[payload_at..]);
    }
    Ok(record)
}

/// [`decode`] of a reply the caller owns: the result or error is the same
/// buffer with the header shifted out, not a copy.
pub(crate) fn decode_owned(mut bytes: Vec<u8>) -> Result<Record, String> {
    let (mut record, payload_at) = decode_fixed(&bytes)?;
    if let Some(payload) = record.result.as_mut().or(record.error.as_mut()) {
        bytes.drain(..payload_at);
        *payload = bytes;
    }
    Ok(record)
}

/// Everything but the payload: the record with an empty result or error where
/// one is flagged, and the offset at which that payload starts.
fn decode_fixed(bytes: &[u8]) -> Result<(Record, usize), String> {
    if bytes.len() < HEADER_LEN {
        return Err(format!(
            "{} bytes is shorter than the {HEADER_LEN}-byte record header",
            bytes.len()
        ));
    }
    if bytes[0] != FORMAT_VERSION {
        return Err(format!("unknown record format version {}", bytes[0]));
    }
    let status = Status::from_code(bytes[1])
        .ok_or_else(|| format!("unknown status byte {:#04x}", bytes[1]))?;
    let attempt = u32::from_be_bytes(array(bytes, 2)?);
    let created_at = timestamp(bytes, 6)?;
    let owner = OwnerToken::from_bytes(array(bytes, 14)?);
    let lease_until = timestamp(bytes, 30)?;
    let expires_at = timestamp(bytes, 38)?;
    let updated_at = timestamp(bytes, 46)?;
    let flags = bytes[54];
    if flags & !(FLAG_FINGERPRINT | FLAG_RESULT | FLAG_ERROR | FLAG_RETRYABLE) != 0 {
        return Err(format!("unknown flags {flags:#04x}"));
    }
    if flags & FLAG_RESULT != 0 && flags & FLAG_ERROR != 0 {
        return Err("both a result and an error are flagged".to_owned());
    }
    let retryable = flags & FLAG_RETRYABLE != 0;
    if retryable && status != Status::Failed {
        return Err(format!("a {status} record is flagged retryable"));
    }
    let mut rest = &bytes[HEADER_LEN..];
    let fingerprint = if flags & FLAG_FINGERPRINT != 0 {
        if rest.len() < FINGERPRINT_LEN {
            return Err("the fingerprint is truncated".to_owned());
        }
        let (fp, tail) = rest.split_at(FINGERPRINT_LEN);
        rest = tail;
        Some(Fingerprint::try_from_slice(fp).map_err(|e| e.to_string())?)
    } else {
        None
    };
    let (result, error) = match (flags & FLAG_RESULT != 0, flags & FLAG_ERROR != 0) {
        (true, _) => (Some(Vec::new()), None),
        (_, true) => (None, Some(Vec::new())),
        _ if rest.is_empty() => (None, None),
        _ => return Err(format!("{} unexpected trailing bytes", rest.len())),
    };
    let payload_at = bytes.len() - rest.len();
    let record = Record {
        status,
        owner,
        attempt,
        fingerprint,
        result,
        error,
        retryable,
        lease_until,
        expires_at,
        created_at,
        updated_at,
    };
    Ok((record, payload_at))
}

fn array<const N: usize>(bytes: &[u8], at: usize) -> Result<[u8; N], String> {
    bytes
        .get(at..at + N)
        .and_then(|s| <[u8; N]>::try_from(s).ok())
        .ok_or_else(|| format!("field at offset {at} is truncated"))
}

fn timestamp(bytes: &[u8], at: usize) -> Result<Timestamp, String> {
    Ok(Timestamp::from_millis(u64::from_be_bytes(array(
        bytes, at,
    )?)))
}

/// The 8 big-endian bytes of a timestamp, as the scripts take them.
pub(crate) fn ts_bytes(t: Timestamp) -> [u8; 8] {
    t.as_millis().to_be_bytes()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Record {
        Record {
            status: Status::Completed,
            owner: OwnerToken::from_u128(0x0102_0304_0506_0708_090a_0b0c_0d0e_0f10),
            attempt: 7,
            fingerprint: Some(Fingerprint::of_bytes(b"payload")),
            result: Some(vec![0, 159, 146, 150, 0, b'\n']),
            error: None,
            retryable: false,
            lease_until: Timestamp::from_millis(1_700_000_000_123),
            expires_at: Timestamp::MAX,
            created_at: Timestamp::from_millis(1),
            updated_at: Timestamp::from_millis(u64::from(u32::MAX) + 1),
        }
    }

    /// Both decoders give `r` back, and the head is the encoding's prefix.
    fn round_trip(r: &Record) {
        let bytes = encode(r);
        assert_eq!(decode(&bytes).unwrap(), *r);
        assert_eq!(decode_owned(bytes.clone()).unwrap(), *r);
        assert!(bytes.starts_with(head(r).as_bytes()));
        let payload = r.result.as_ref().or(r.error.as_ref()).map_or(0, Vec::len);
        assert_eq!(head(r).as_bytes().len() + payload, bytes.len());
    }

    #[test]
    fn round_trips() {
        let mut r = sample();
        round_trip(&r);
        r.result = Some(Vec::new());
        round_trip(&r);
        r.result = None;
        r.fingerprint = None;
        round_trip(&r);
        r.status = Status::Failed;
        r.error = Some(b"\0boom\xff".to_vec());
        round_trip(&r);
        r.error = Some(Vec::new());
        round_trip(&r);
        r.retryable = true;
        round_trip(&r);
        assert_eq!(encode(&r)[54], FLAG_ERROR | FLAG_RETRYABLE);
        r.error = None;
        round_trip(&r);
        r.fingerprint = Some(Fingerprint::of_bytes(b"y"));
        r.error = Some(b"again".to_vec());
        round_trip(&r);
        assert_eq!(
            encode(&r)[54],
            FLAG_FINGERPRINT | FLAG_ERROR | FLAG_RETRYABLE
        );
        r.fingerprint = None;
        r.retryable = false;
        r.status = Status::Processing;
        r.error = None;
        round_trip(&r);
        assert_eq!(encode(&r).len(), HEADER_LEN);
        r.fingerprint = Some(Fingerprint::of_bytes(b"x"));
        round_trip(&r);
        assert_eq!(encode(&r).len(), HEADER_LEN + FINGERPRINT_LEN);
    }

    #[test]
    fn layout_is_stable() {
        let bytes = encode(&sample());
        assert_eq!(bytes[0], FORMAT_VERSION);
        assert_eq!(bytes[1], b'C');
        assert_eq!(&bytes[2..6], &7u32.to_be_bytes());
        assert_eq!(&bytes[6..14], &1u64.to_be_bytes());
        assert_eq!(&bytes[14..30], &sample().owner.to_bytes());
        assert_eq!(&bytes[38..46], &[0xff; 8]);
        assert_eq!(bytes[54], FLAG_FINGERPRINT | FLAG_RESULT);
        assert_eq!(bytes.len(), HEADER_LEN + FINGERPRINT_LEN + 6);
    }

    /// A record as the previous version of this crate wrote it (flags without
    /// bit 3, byte for byte): it still decodes, as not retryable.
    #[test]
    fn decodes_records_of_the_previous_version() {
        let mut bytes = vec![1u8, b'F'];
        bytes.extend_from_slice(&3u32.to_be_bytes());
        bytes.extend_from_slice(&10u64.to_be_bytes());
        bytes.extend_from_slice(&42u128.to_be_bytes());
        bytes.extend_from_slice(&20u64.to_be_bytes());
        bytes.extend_from_slice(&30u64.to_be_bytes());
        bytes.extend_from_slice(&40u64.to_be_bytes());
        bytes.push(FLAG_FINGERPRINT | FLAG_ERROR);
        bytes.extend_from_slice(&[9; 32]);
        bytes.extend_from_slice(b"declined");
        let r = decode(&bytes).unwrap();
        assert_eq!(
            (r.status, r.attempt, r.owner, r.retryable),
            (Status::Failed, 3, OwnerToken::from_u128(42), false)
        );
        assert_eq!(
            (r.created_at, r.lease_until, r.expires_at, r.updated_at),
            (
                Timestamp::from_millis(10),
                Timestamp::from_millis(20),
                Timestamp::from_millis(30),
                Timestamp::from_millis(40)
            )
        );
        assert_eq!(r.fingerprint, Some(Fingerprint::from_bytes([9; 32])));
        assert_eq!(r.error.as_deref(), Some(&b"declined"[..]));
        // Re-encoded by this version: the same bytes.
        assert_eq!(encode(&r), bytes);
    }

    #[test]
    fn rejects_garbage_without_panicking() {
        let good = encode(&sample());
        let mut cases: Vec<Vec<u8>> = vec![
            Vec::new(),
            b"hello".to_vec(),
            vec![0; HEADER_LEN],
            good[..HEADER_LEN - 1].to_vec(),
            good[..HEADER_LEN + 10].to_vec(),
        ];
        let mut bad_version = good.clone();
        bad_version[0] = 2;
        cases.push(bad_version);
        let mut bad_status = good.clone();
        bad_status[1] = b'X';
        cases.push(bad_status);
        let mut bad_flags = good.clone();
        bad_flags[54] = 0x80;
        cases.push(bad_flags);
        let mut both = good.clone();
        both[54] = FLAG_RESULT | FLAG_ERROR;
        cases.push(both);
        // Retryable is only ever stored on a failed record.
        let mut retryable_completed = good.clone();
        retryable_completed[54] |= FLAG_RETRYABLE;
        cases.push(retryable_completed);
        let mut retryable_processing = encode(&Record {
            result: None,
            status: Status::Processing,
            ..sample()
        });
        retryable_processing[54] |= FLAG_RETRYABLE;
        cases.push(retryable_processing);
        let mut trailing = encode(&Record {
            result: None,
            status: Status::Processing,
            ..sample()
        });
        trailing.push(1);
        cases.push(trailing);
        for case in cases {
            assert!(decode(&case).is_err(), "{case:?}");
            assert_eq!(decode_owned(case.clone()), decode(&case), "{case:?}");
        }
        // Every prefix of a valid record either parses or fails cleanly, the
        // same way through both decoders.
        for n in 0..good.len() {
            assert_eq!(decode_owned(good[..n].to_vec()), decode(&good[..n]));
        }
    }
}
