//! Canonical JSON written directly, without building a `serde_json::Value`.
//!
//! The reference is the `Value` route: `serde_json::to_value` then
//! `serde_json::to_vec`. `Value` objects are `BTreeMap<String, Value>`s, so that
//! route sorts object keys at every depth by their unescaped bytes and collapses
//! duplicate keys (the last value wins). It allocates per key and per value, and
//! it is on the hot path of every execution (payload fingerprints).
//!
//! [`Canon`] produces the same bytes in one buffer: every value is written in
//! place, and each object records where its entries start and end. When an
//! object closes, its entries are checked for order; only when they are not
//! strictly sorted is the object's region copied aside once and written back in
//! key order, dropping all but the last of equal keys. Scalars and strings are
//! written by `serde_json`'s own serializer, so escaping and number formatting
//! are `serde_json`'s.
//!
//! Whatever is not certainly rendered the way `Value` renders it (`serde_json`'s
//! private magic structs, map keys other than strings, chars, integers, unit
//! variants and newtypes of those, 128-bit integers outside the 64-bit ranges,
//! misordered `serialize_key`/`serialize_value` calls) makes the fast path give
//! up with [`FastError::Unsupported`], and the value is serialized again through
//! the `Value` route. Errors raised by `Serialize` implementations are reported
//! as the `Value` route would report them.
//!
//! [`text`] writes the canonical form of a JSON *text* instead, without the
//! losses of reading it into a `Value` first.

use std::cell::RefCell;
use std::cmp::Ordering;
use std::fmt;
use std::io::Write as _;

use serde::ser::{self, Impossible, Serialize};

use crate::error::Error;

mod text;
pub use text::canonical_json_text;

/// Buffers larger than this are not kept for the next call.
const KEEP_BYTES: usize = 64 * 1024;
/// Entry stacks longer than this are not kept for the next call.
const KEEP_ENTRIES: usize = 1024;

thread_local! {
    /// Per-thread buffers, reused so a call allocates nothing once warm.
    static BUFFERS: RefCell<Canon> = const { RefCell::new(Canon::new()) };
}

/// The canonical JSON of `value` as bytes.
pub(crate) fn to_vec<T: Serialize + ?Sized>(value: &T) -> Result<Vec<u8>, Error> {
    with_canonical(value, <[u8]>::to_vec)
}

/// Calls `f` with the canonical JSON of `value`, in the per-thread buffer.
pub(crate) fn with_canonical<T, R, F>(value: &T, f: F) -> Result<R, Error>
where
    T: Serialize + ?Sized,
    F: Fn(&[u8]) -> R,
{
    match fast(value, &f) {
        Ok(result) => Ok(result),
        Err(e) => fall_back(value, e).map(|bytes| f(&bytes)),
    }
}

/// `f` of the fast path's output.
fn fast<T, R, F>(value: &T, f: &F) -> Result<R, FastError>
where
    T: Serialize + ?Sized,
    F: Fn(&[u8]) -> R,
{
    let finish = |canon: &mut Canon| {
        // Emptied first as well: a `Serialize` impl that panicked mid-way left
        // its partial output behind.
        canon.recycle();
        let result = value.serialize(&mut *canon).map(|()| f(&canon.out));
        canon.recycle();
        result
    };
    // A `Serialize` impl asking for canonical JSON while being serialized finds
    // the buffers borrowed, and a call during thread teardown finds them gone:
    // both get fresh ones.
    BUFFERS
        .try_with(|cell| match cell.try_borrow_mut() {
            Ok(mut canon) => finish(&mut canon),
            Err(_) => finish(&mut Canon::new()),
        })
        .unwrap_or_else(|_| finish(&mut Canon::new()))
}

/// The result when the fast path stopped with `e`.
#[cold]
fn fall_back<T: Serialize + ?Sized>(value: &T, e: FastError) -> Result<Vec<u8>, Error> {
    match e {
        FastError::Custom(e) => Err(codec(e)),
        FastError::Unsupported => canonical_json_via_value(value),
    }
}

/// The reference route: through a `serde_json::Value`, whose objects are
/// `BTreeMap`s (`serde_json` is built without `preserve_order`).
fn canonical_json_via_value<T: Serialize + ?Sized>(value: &T) -> Result<Vec<u8>, Error> {
    let v = serde_json::to_value(value).map_err(codec)?;
    serde_json::to_vec(&v).map_err(codec)
}

fn codec(e: serde_json::Error) -> Error {
    Error::Codec { source: e.into() }
}

/// Why the fast serializer stopped.
#[derive(Debug)]
enum FastError {
    /// Not certainly rendered as the `Value` route renders it: use that route.
    Unsupported,
    /// An error raised by a `Serialize` implementation, as `to_value` would
    /// have reported it (one pointer: results stay in registers).
    Custom(serde_json::Error),
}

impl fmt::Display for FastError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FastError::Unsupported => {
                f.write_str("not supported by the direct canonical serializer")
            }
            FastError::Custom(e) => e.fmt(f),
        }
    }
}

impl std::error::Error for FastError {}

impl ser::Error for FastError {
    fn custom<T: fmt::Display>(msg: T) -> Self {
        FastError::Custom(<serde_json::Error as ser::Error>::custom(msg))
    }
}

/// Refuses NaN and the infinities: JSON has no form for them (`serde_json`
/// writes `null`), so `NaN`, `+inf`, `-inf` and `null` would all hash alike and
/// a payload carrying one would match a payload carrying another.
fn finite(v: f64) -> Result<(), FastError> {
    if v.is_finite() {
        Ok(())
    } else {
        Err(<FastError as ser::Error>::custom(format_args!(
            "the payload holds a non-finite number ({v}), which JSON cannot represent: \
             it would fingerprint like `null`; send it as a string or reject it before \
             calling the layer"
        )))
    }
}

/// The first 8 bytes of a key, zero-padded, big-endian: ordering these orders
/// the keys unless they are equal (a padding zero only meets a real byte in a
/// longer key, which sorts after its prefix anyway).
#[inline]
fn prefix(key: &[u8]) -> u64 {
    match key.first_chunk::<8>() {
        Some(head) => u64::from_be_bytes(*head),
        None => key
            .iter()
            .enumerate()
            .fold(0, |p, (i, &b)| p | u64::from(b) << (56 - 8 * i)),
    }
}

/// An object key: a `'static` name (struct fields, variants) or a range of
/// [`Scratch::keys`] holding the unescaped key.
#[derive(Debug, Clone, Copy)]
enum Key {
    Static(&'static str),
    Arena(usize, usize),
}

impl Key {
    #[inline]
    fn bytes<'a>(&self, arena: &'a [u8]) -> &'a [u8] {
        match *self {
            Key::Static(s) => s.as_bytes(),
            Key::Arena(start, end) => &arena[start..end],
        }
    }
}

/// One written object entry: `"key":value` spans `start..end` of [`Canon::out`].
#[derive(Debug, Clone, Copy)]
struct Entry {
    /// [`prefix`] of the key, compared first.
    prefix: u64,
    key: Key,
    start: usize,
    end: usize,
}

impl Entry {
    /// The order of the keys as `String`s (a `BTreeMap<String, _>`'s): bytewise.
    #[inline]
    fn cmp_key(&self, other: &Entry, arena: &[u8]) -> Ordering {
        self.prefix
            .cmp(&other.prefix)
            .then_with(|| self.key.bytes(arena).cmp(other.key.bytes(arena)))
    }
}

/// Empties `v`, or drops it if its capacity exceeds `keep`.
fn reset<T>(v: &mut Vec<T>, keep: usize) {
    if v.capacity() > keep {
        *v = Vec::new();
    } else {
        v.clear();
    }
}

/// Buffers shared by all the objects being written: each open object owns the
/// top of the stacks.
#[derive(Debug)]
struct Scratch {
    /// The entries of the open objects, innermost last.
    entries: Vec<Entry>,
    /// The unescaped map keys of the open objects, innermost last.
    keys: Vec<u8>,
    /// Where an object's region is copied while it is reordered.
    tmp: Vec<u8>,
}

impl Scratch {
    const fn new() -> Self {
        Scratch {
            entries: Vec::new(),
            keys: Vec::new(),
            tmp: Vec::new(),
        }
    }
}

/// The serializer's state: the output, and the bookkeeping of the objects
/// being written.
#[derive(Debug)]
struct Canon {
    /// The canonical JSON written so far.
    out: Vec<u8>,
    scratch: Scratch,
}

impl Canon {
    const fn new() -> Self {
        Canon {
            out: Vec::new(),
            scratch: Scratch::new(),
        }
    }

    /// Empties the buffers, dropping the ones grown too large to keep around.
    fn recycle(&mut self) {
        reset(&mut self.out, KEEP_BYTES);
        reset(&mut self.scratch.entries, KEEP_ENTRIES);
        reset(&mut self.scratch.keys, KEEP_BYTES);
        reset(&mut self.scratch.tmp, KEEP_BYTES);
    }

    /// Writes a scalar with `serde_json`'s serializer (its number formatting).
    fn json<F>(&mut self, write: F) -> Result<(), FastError>
    where
        F: FnOnce(&mut serde_json::Serializer<&mut Vec<u8>>) -> serde_json::Result<()>,
    {
        // Writing into a `Vec` cannot fail; if it somehow did, let the `Value`
        // route report it.
        write(&mut serde_json::Serializer::new(&mut self.out)).map_err(|_| FastError::Unsupported)
    }

    /// Writes a JSON string, escaped exactly as `serde_json` escapes it.
    fn string(&mut self, s: &str) -> Result<(), FastError> {
        self.json(|w| ser::Serializer::serialize_str(w, s))
    }

    /// Writes `{"variant":`, the start of an externally tagged variant.
    fn open_variant(&mut self, variant: &str) -> Result<(), FastError> {
        self.out.push(b'{');
        self.string(variant)?;
        self.out.push(b':');
        Ok(())
    }

    fn open_object(&mut self, wrapped: bool) -> Object<'_> {
        self.out.push(b'{');
        Object {
            body: self.out.len(),
            entries: self.scratch.entries.len(),
            keys: self.scratch.keys.len(),
            pending: false,
            wrapped,
            canon: self,
        }
    }

    fn open_array(&mut self, wrapped: bool) -> Array<'_> {
        self.out.push(b'[');
        Array {
            canon: self,
            first: true,
            wrapped,
        }
    }
}

impl<'a> ser::Serializer for &'a mut Canon {
    type Ok = ();
    type Error = FastError;
    type SerializeSeq = Array<'a>;
    type SerializeTuple = Array<'a>;
    type SerializeTupleStruct = Array<'a>;
    type SerializeTupleVariant = Array<'a>;
    type SerializeMap = Object<'a>;
    type SerializeStruct = Object<'a>;
    type SerializeStructVariant = Object<'a>;

    fn serialize_bool(self, v: bool) -> Result<(), FastError> {
        self.out
            .extend_from_slice(if v { b"true" } else { b"false" });
        Ok(())
    }

    fn serialize_i8(self, v: i8) -> Result<(), FastError> {
        self.serialize_i64(v.into())
    }

    fn serialize_i16(self, v: i16) -> Result<(), FastError> {
        self.serialize_i64(v.into())
    }

    fn serialize_i32(self, v: i32) -> Result<(), FastError> {
        self.serialize_i64(v.into())
    }

    fn serialize_i64(self, v: i64) -> Result<(), FastError> {
        self.json(|w| ser::Serializer::serialize_i64(w, v))
    }

    fn serialize_i128(self, v: i128) -> Result<(), FastError> {
        // `Value` holds 64-bit integers only; outside that range `to_value` fails
        // (or, with `arbitrary_precision`, keeps the digits): its call.
        if let Ok(v) = u64::try_from(v) {
            self.serialize_u64(v)
        } else if let Ok(v) = i64::try_from(v) {
            self.serialize_i64(v)
        } else {
            Err(FastError::Unsupported)
        }
    }

    fn serialize_u8(self, v: u8) -> Result<(), FastError> {
        self.serialize_u64(v.into())
    }

    fn serialize_u16(self, v: u16) -> Result<(), FastError> {
        self.serialize_u64(v.into())
    }

    fn serialize_u32(self, v: u32) -> Result<(), FastError> {
        self.serialize_u64(v.into())
    }

    fn serialize_u64(self, v: u64) -> Result<(), FastError> {
        self.json(|w| ser::Serializer::serialize_u64(w, v))
    }

    fn serialize_u128(self, v: u128) -> Result<(), FastError> {
        match u64::try_from(v) {
            Ok(v) => self.serialize_u64(v),
            Err(_) => Err(FastError::Unsupported),
        }
    }

    fn serialize_f32(self, v: f32) -> Result<(), FastError> {
        finite(f64::from(v))?;
        // Exactly what `to_value` stores (without `arbitrary_precision`: the
        // widened `f64`, so `0.1f32` prints as `0.10000000149011612`), written
        // the way `Value` writes it.
        self.json(|w| serde_json::Value::from(v).serialize(w))
    }

    fn serialize_f64(self, v: f64) -> Result<(), FastError> {
        finite(v)?;
        self.json(|w| ser::Serializer::serialize_f64(w, v))
    }

    fn serialize_char(self, v: char) -> Result<(), FastError> {
        self.string(v.encode_utf8(&mut [0; 4]))
    }

    fn serialize_str(self, v: &str) -> Result<(), FastError> {
        self.string(v)
    }

    fn serialize_bytes(self, v: &[u8]) -> Result<(), FastError> {
        // An array of numbers, like `Value`.
        let mut array = self.open_array(false);
        for b in v {
            ser::SerializeSeq::serialize_element(&mut array, b)?;
        }
        ser::SerializeSeq::end(array)
    }

    fn serialize_none(self) -> Result<(), FastError> {
        self.serialize_unit()
    }

    fn serialize_some<T: Serialize + ?Sized>(self, value: &T) -> Result<(), FastError> {
        value.serialize(self)
    }

    fn serialize_unit(self) -> Result<(), FastError> {
        self.out.extend_from_slice(b"null");
        Ok(())
    }

    fn serialize_unit_struct(self, _name: &'static str) -> Result<(), FastError> {
        self.serialize_unit()
    }

    fn serialize_unit_variant(
        self,
        _name: &'static str,
        _index: u32,
        variant: &'static str,
    ) -> Result<(), FastError> {
        self.string(variant)
    }

    fn serialize_newtype_struct<T: Serialize + ?Sized>(
        self,
        _name: &'static str,
        value: &T,
    ) -> Result<(), FastError> {
        value.serialize(self)
    }

    fn serialize_newtype_variant<T: Serialize + ?Sized>(
        self,
        _name: &'static str,
        _index: u32,
        variant: &'static str,
        value: &T,
    ) -> Result<(), FastError> {
        self.open_variant(variant)?;
        value.serialize(&mut *self)?;
        self.out.push(b'}');
        Ok(())
    }

    fn serialize_seq(self, _len: Option<usize>) -> Result<Array<'a>, FastError> {
        Ok(self.open_array(false))
    }

    fn serialize_tuple(self, _len: usize) -> Result<Array<'a>, FastError> {
        Ok(self.open_array(false))
    }

    fn serialize_tuple_struct(
        self,
        _name: &'static str,
        _len: usize,
    ) -> Result<Array<'a>, FastError> {
        Ok(self.open_array(false))
    }

    fn serialize_tuple_variant(
        self,
        _name: &'static str,
        _index: u32,
        variant: &'static str,
        _len: usize,
    ) -> Result<Array<'a>, FastError> {
        self.open_variant(variant)?;
        Ok(self.open_array(true))
    }

    fn serialize_map(self, _len: Option<usize>) -> Result<Object<'a>, FastError> {
        Ok(self.open_object(false))
    }

    fn serialize_struct(self, name: &'static str, _len: usize) -> Result<Object<'a>, FastError> {
        // `$serde_json::private::RawValue` and `…::Number` (`arbitrary_precision`)
        // are magic to `to_value`; derived structs cannot have such names.
        if name.starts_with('$') {
            return Err(FastError::Unsupported);
        }
        Ok(self.open_object(false))
    }

    fn serialize_struct_variant(
        self,
        _name: &'static str,
        _index: u32,
        variant: &'static str,
        _len: usize,
    ) -> Result<Object<'a>, FastError> {
        self.open_variant(variant)?;
        Ok(self.open_object(true))
    }
}

/// An array being written; `wrapped` when it is the value of `{"Variant":…}`.
#[derive(Debug)]
struct Array<'a> {
    canon: &'a mut Canon,
    first: bool,
    wrapped: bool,
}

impl Array<'_> {
    fn element<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<(), FastError> {
        if !self.first {
            self.canon.out.push(b',');
        }
        self.first = false;
        value.serialize(&mut *self.canon)
    }

    fn close(self) -> Result<(), FastError> {
        self.canon.out.push(b']');
        if self.wrapped {
            self.canon.out.push(b'}');
        }
        Ok(())
    }
}

/// The four sequence-like `Serialize*` traits: each writes array elements.
macro_rules! array_impls {
    ($($serialize:ident :: $element:ident),* $(,)?) => {$(
        impl ser::$serialize for Array<'_> {
            type Ok = ();
            type Error = FastError;

            fn $element<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<(), FastError> {
                self.element(value)
            }

            fn end(self) -> Result<(), FastError> {
                self.close()
            }
        }
    )*};
}

array_impls!(
    SerializeSeq::serialize_element,
    SerializeTuple::serialize_element,
    SerializeTupleStruct::serialize_field,
    SerializeTupleVariant::serialize_field,
);

/// An object being written. Its body starts at `out[body]`; its entries and
/// map keys are `entries[entries..]` and `keys[keys..]`.
#[derive(Debug)]
struct Object<'a> {
    canon: &'a mut Canon,
    body: usize,
    entries: usize,
    keys: usize,
    /// A key was written and its value is due.
    pending: bool,
    /// The object is the value of `{"Variant":…}`.
    wrapped: bool,
}

impl Object<'_> {
    /// Writes the separator and the key of a new entry, then `:`.
    fn key<F>(&mut self, write_key: F) -> Result<(), FastError>
    where
        F: FnOnce(&mut Canon) -> Result<Key, FastError>,
    {
        if self.pending {
            // `to_value` would silently replace the pending key.
            return Err(FastError::Unsupported);
        }
        if self.canon.scratch.entries.len() > self.entries {
            self.canon.out.push(b',');
        }
        let start = self.canon.out.len();
        let key = write_key(self.canon)?;
        self.canon.out.push(b':');
        self.canon.scratch.entries.push(Entry {
            prefix: prefix(key.bytes(&self.canon.scratch.keys)),
            key,
            start,
            end: start,
        });
        self.pending = true;
        Ok(())
    }

    fn value<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<(), FastError> {
        if !self.pending {
            // `to_value` panics on this; let it.
            return Err(FastError::Unsupported);
        }
        value.serialize(&mut *self.canon)?;
        self.pending = false;
        // Nested objects popped their own entries: ours is the last one.
        match self.canon.scratch.entries.last_mut() {
            Some(entry) => {
                entry.end = self.canon.out.len();
                Ok(())
            }
            None => Err(FastError::Unsupported),
        }
    }

    fn field<T: Serialize + ?Sized>(
        &mut self,
        key: &'static str,
        value: &T,
    ) -> Result<(), FastError> {
        self.key(|canon| canon.string(key).map(|()| Key::Static(key)))?;
        self.value(value)
    }

    /// Puts the entries in key order (last of equal keys wins) and closes.
    fn close(self) -> Result<(), FastError> {
        if self.pending {
            return Err(FastError::Unsupported);
        }
        let canon = self.canon;
        let arena = &canon.scratch.keys;
        let entries = &mut canon.scratch.entries[self.entries..];
        let sorted = entries
            .windows(2)
            .all(|w| w[0].cmp_key(&w[1], arena).is_lt());
        if !sorted {
            // Equal keys stay in writing order, so the last of a run is the
            // value `BTreeMap::insert` would have kept.
            entries.sort_unstable_by(|a, b| a.cmp_key(b, arena).then(a.start.cmp(&b.start)));
            canon.scratch.tmp.clear();
            canon.scratch.tmp.extend_from_slice(&canon.out[self.body..]);
            canon.out.truncate(self.body);
            let mut first = true;
            for (i, entry) in entries.iter().enumerate() {
                if entries
                    .get(i + 1)
                    .is_some_and(|next| next.cmp_key(entry, arena).is_eq())
                {
                    continue;
                }
                if !first {
                    canon.out.push(b',');
                }
                first = false;
                canon.out.extend_from_slice(
                    &canon.scratch.tmp[entry.start - self.body..entry.end - self.body],
                );
            }
        }
        canon.scratch.entries.truncate(self.entries);
        canon.scratch.keys.truncate(self.keys);
        canon.out.push(b'}');
        if self.wrapped {
            canon.out.push(b'}');
        }
        Ok(())
    }
}

impl ser::SerializeMap for Object<'_> {
    type Ok = ();
    type Error = FastError;

    fn serialize_key<T: Serialize + ?Sized>(&mut self, key: &T) -> Result<(), FastError> {
        self.key(|canon| key.serialize(KeyWriter { canon }))
    }

    fn serialize_value<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<(), FastError> {
        self.value(value)
    }

    fn end(self) -> Result<(), FastError> {
        self.close()
    }
}

/// Structs and struct variants: named fields, written as object entries.
macro_rules! struct_impls {
    ($($serialize:ident),* $(,)?) => {$(
        impl ser::$serialize for Object<'_> {
            type Ok = ();
            type Error = FastError;

            fn serialize_field<T: Serialize + ?Sized>(
                &mut self,
                key: &'static str,
                value: &T,
            ) -> Result<(), FastError> {
                self.field(key, value)
            }

            fn end(self) -> Result<(), FastError> {
                self.close()
            }
        }
    )*};
}

struct_impls!(SerializeStruct, SerializeStructVariant);

/// Writes a map key as a JSON string and returns its unescaped form, for the
/// key kinds `to_value`'s key serializer turns into strings the obvious way.
#[derive(Debug)]
struct KeyWriter<'a> {
    canon: &'a mut Canon,
}

impl KeyWriter<'_> {
    fn integer(self, v: impl fmt::Display) -> Result<Key, FastError> {
        // `Display` of an integer is the same decimal text as `itoa`'s.
        let canon = self.canon;
        let start = canon.scratch.keys.len();
        write!(canon.scratch.keys, "{v}").map_err(|_| FastError::Unsupported)?;
        canon.out.push(b'"');
        canon.out.extend_from_slice(&canon.scratch.keys[start..]);
        canon.out.push(b'"');
        Ok(Key::Arena(start, canon.scratch.keys.len()))
    }
}

type NoKey = Impossible<Key, FastError>;

impl ser::Serializer for KeyWriter<'_> {
    type Ok = Key;
    type Error = FastError;
    type SerializeSeq = NoKey;
    type SerializeTuple = NoKey;
    type SerializeTupleStruct = NoKey;
    type SerializeTupleVariant = NoKey;
    type SerializeMap = NoKey;
    type SerializeStruct = NoKey;
    type SerializeStructVariant = NoKey;

    fn serialize_str(self, v: &str) -> Result<Key, FastError> {
        let canon = self.canon;
        let start = canon.scratch.keys.len();
        canon.scratch.keys.extend_from_slice(v.as_bytes());
        canon.string(v)?;
        Ok(Key::Arena(start, canon.scratch.keys.len()))
    }

    fn serialize_char(self, v: char) -> Result<Key, FastError> {
        self.serialize_str(v.encode_utf8(&mut [0; 4]))
    }

    fn serialize_unit_variant(
        self,
        _name: &'static str,
        _index: u32,
        variant: &'static str,
    ) -> Result<Key, FastError> {
        self.canon.string(variant)?;
        Ok(Key::Static(variant))
    }

    fn serialize_newtype_struct<T: Serialize + ?Sized>(
        self,
        _name: &'static str,
        value: &T,
    ) -> Result<Key, FastError> {
        value.serialize(self)
    }

    fn serialize_i8(self, v: i8) -> Result<Key, FastError> {
        self.integer(v)
    }

    fn serialize_i16(self, v: i16) -> Result<Key, FastError> {
        self.integer(v)
    }

    fn serialize_i32(self, v: i32) -> Result<Key, FastError> {
        self.integer(v)
    }

    fn serialize_i64(self, v: i64) -> Result<Key, FastError> {
        self.integer(v)
    }

    fn serialize_i128(self, v: i128) -> Result<Key, FastError> {
        self.integer(v)
    }

    fn serialize_u8(self, v: u8) -> Result<Key, FastError> {
        self.integer(v)
    }

    fn serialize_u16(self, v: u16) -> Result<Key, FastError> {
        self.integer(v)
    }

    fn serialize_u32(self, v: u32) -> Result<Key, FastError> {
        self.integer(v)
    }

    fn serialize_u64(self, v: u64) -> Result<Key, FastError> {
        self.integer(v)
    }

    fn serialize_u128(self, v: u128) -> Result<Key, FastError> {
        self.integer(v)
    }

    // Everything below: the `Value` route decides (a string for bools and
    // finite floats, an error for the rest).

    fn serialize_bool(self, _v: bool) -> Result<Key, FastError> {
        Err(FastError::Unsupported)
    }

    fn serialize_f32(self, _v: f32) -> Result<Key, FastError> {
        Err(FastError::Unsupported)
    }

    fn serialize_f64(self, _v: f64) -> Result<Key, FastError> {
        Err(FastError::Unsupported)
    }

    fn serialize_bytes(self, _v: &[u8]) -> Result<Key, FastError> {
        Err(FastError::Unsupported)
    }

    fn serialize_none(self) -> Result<Key, FastError> {
        Err(FastError::Unsupported)
    }

    fn serialize_some<T: Serialize + ?Sized>(self, _value: &T) -> Result<Key, FastError> {
        Err(FastError::Unsupported)
    }

    fn serialize_unit(self) -> Result<Key, FastError> {
        Err(FastError::Unsupported)
    }

    fn serialize_unit_struct(self, _name: &'static str) -> Result<Key, FastError> {
        Err(FastError::Unsupported)
    }

    fn serialize_newtype_variant<T: Serialize + ?Sized>(
        self,
        _name: &'static str,
        _index: u32,
        _variant: &'static str,
        _value: &T,
    ) -> Result<Key, FastError> {
        Err(FastError::Unsupported)
    }

    fn serialize_seq(self, _len: Option<usize>) -> Result<NoKey, FastError> {
        Err(FastError::Unsupported)
    }

    fn serialize_tuple(self, _len: usize) -> Result<NoKey, FastError> {
        Err(FastError::Unsupported)
    }

    fn serialize_tuple_struct(self, _name: &'static str, _len: usize) -> Result<NoKey, FastError> {
        Err(FastError::Unsupported)
    }

    fn serialize_tuple_variant(
        self,
        _name: &'static str,
        _index: u32,
        _variant: &'static str,
        _len: usize,
    ) -> Result<NoKey, FastError> {
        Err(FastError::Unsupported)
    }

    fn serialize_map(self, _len: Option<usize>) -> Result<NoKey, FastError> {
        Err(FastError::Unsupported)
    }

    fn serialize_struct(self, _name: &'static str, _len: usize) -> Result<NoKey, FastError> {
        Err(FastError::Unsupported)
    }

    fn serialize_struct_variant(
        self,
        _name: &'static str,
        _index: u32,
        _variant: &'static str,
        _len: usize,
    ) -> Result<NoKey, FastError> {
        Err(FastError::Unsupported)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::{BTreeMap, HashMap};
    use std::fmt::Debug;

    use serde::ser::{Error as _, SerializeMap as _, SerializeStruct as _};
    use serde::{Serialize, Serializer};
    use serde_json::{json, Value};

    use super::*;

    /// The fast path alone, without the fallback.
    fn fast_only<T: Serialize + ?Sized>(value: &T) -> Result<Vec<u8>, FastError> {
        let mut canon = Canon::new();
        value.serialize(&mut canon).map(|()| canon.out)
    }

    fn outcome(r: Result<Vec<u8>, Error>) -> Result<String, String> {
        r.map(|b| String::from_utf8(b).unwrap())
            .map_err(|e| match e {
                Error::Codec { source } => source.to_string(),
                other => panic!("not a codec error: {other:?}"),
            })
    }

    /// `to_vec` equals the `Value` route (bytes, or the error's message).
    #[track_caller]
    fn same_as_value<T: Serialize + ?Sized + Debug>(value: &T) -> Result<String, String> {
        let oracle = outcome(canonical_json_via_value(value));
        assert_eq!(outcome(to_vec(value)), oracle, "for {value:?}");
        oracle
    }

    /// The fast path handles `value` itself and equals the `Value` route.
    #[track_caller]
    fn fast_same<T: Serialize + ?Sized + Debug>(value: &T) -> String {
        let oracle = same_as_value(value).unwrap();
        let fast =
            fast_only(value).unwrap_or_else(|e| panic!("fast path gave up ({e}) on {value:?}"));
        assert_eq!(String::from_utf8(fast).unwrap(), oracle, "for {value:?}");
        oracle
    }

    /// The fast path gives up on `value`, and the result is the `Value` route's.
    #[track_caller]
    fn falls_back<T: Serialize + ?Sized + Debug>(value: &T) -> Result<String, String> {
        assert!(
            matches!(fast_only(value), Err(FastError::Unsupported)),
            "expected a fallback for {value:?}"
        );
        same_as_value(value)
    }

    #[test]
    fn non_finite_numbers_are_refused() {
        // NaN, +inf, -inf and null would all be `null` in JSON, so they would
        // fingerprint alike: refused, wherever they sit.
        let cases: Vec<Value> = vec![json!(null)];
        assert!(to_vec(&cases).is_ok());
        for v in [f64::NAN, f64::INFINITY, f64::NEG_INFINITY] {
            for err in [
                outcome(to_vec(&v)),
                outcome(to_vec(&vec![1.0, v])),
                outcome(to_vec(&std::collections::BTreeMap::from([("amount", v)]))),
                outcome(to_vec(&(v as f32))),
            ] {
                let message = err.unwrap_err();
                assert!(message.contains("non-finite number"), "{message}");
            }
        }
        assert_ne!(to_vec(&f64::MAX).unwrap(), to_vec(&()).unwrap());
    }

    /// xorshift64*, seeded (also for `canonical::text`'s tests).
    pub(super) struct Rng(pub(super) u64);

    impl Rng {
        pub(super) fn next(&mut self) -> u64 {
            // xorshift64*
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
        }

        pub(super) fn below(&mut self, n: usize) -> usize {
            (self.next() % n as u64) as usize
        }

        pub(super) fn pick<T: Copy>(&mut self, items: &[T]) -> T {
            items[self.below(items.len())]
        }
    }

    /// Keys whose escaped and unescaped orders differ, and UTF-8 vs UTF-16 order.
    const KEYS: &[&str] = &[
        "", "a", "b", "A", "aa", "ab", "\"", "!", "#", "\\", "]", "[", "\u{1}", "\u{0}", "0", "\n",
        "\t", " ", "\u{1f}", "\u{7f}", "~", "\u{80}", "é", "ü", "z", "🦀", "\u{ffff}", "\u{e000}",
        "a\"b", "a\\b", "a b", "id", "amount", "\u{2028}", "zz\u{1}", "zz",
    ];
    const CHARS: &[char] = &[
        'a', 'b', '"', '\\', '\u{1}', '\n', '\u{7f}', 'é', '🦀', '\u{ffff}', ' ', '0',
    ];

    #[derive(Debug, Clone)]
    enum GenKey {
        Str(String),
        U64(u64),
        I64(i64),
        I128(i128),
        Char(char),
        Variant(&'static str),
        // Left to the `Value` route.
        Bool(bool),
        F64(f64),
        Unit,
    }

    #[derive(Debug, Clone)]
    enum Gen {
        Null,
        Bool(bool),
        U64(u64),
        I64(i64),
        I128(i128),
        U128(u128),
        F64(f64),
        F32(f32),
        Str(String),
        Char(char),
        Bytes(Vec<u8>),
        Some(Box<Gen>),
        Variant(&'static str, Box<Gen>),
        Arr(Vec<Gen>),
        /// Entries in this order, duplicates included.
        Obj(Vec<(GenKey, Gen)>),
        /// The same, through `serialize_struct` when all keys are `'static`.
        Struct(Vec<(&'static str, Gen)>),
    }

    impl Serialize for GenKey {
        fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
            match self {
                GenKey::Str(k) => s.serialize_str(k),
                GenKey::U64(k) => s.serialize_u64(*k),
                GenKey::I64(k) => s.serialize_i64(*k),
                GenKey::I128(k) => s.serialize_i128(*k),
                GenKey::Char(k) => s.serialize_char(*k),
                GenKey::Variant(k) => s.serialize_unit_variant("K", 0, k),
                GenKey::Bool(k) => s.serialize_bool(*k),
                GenKey::F64(k) => s.serialize_f64(*k),
                GenKey::Unit => s.serialize_unit(),
            }
        }
    }

    impl Serialize for Gen {
        fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
            match self {
                Gen::Null => s.serialize_unit(),
                Gen::Bool(v) => s.serialize_bool(*v),
                Gen::U64(v) => s.serialize_u64(*v),
                Gen::I64(v) => s.serialize_i64(*v),
                Gen::I128(v) => s.serialize_i128(*v),
                Gen::U128(v) => s.serialize_u128(*v),
                Gen::F64(v) => s.serialize_f64(*v),
                Gen::F32(v) => s.serialize_f32(*v),
                Gen::Str(v) => s.serialize_str(v),
                Gen::Char(v) => s.serialize_char(*v),
                Gen::Bytes(v) => s.serialize_bytes(v),
                Gen::Some(v) => s.serialize_some(v),
                Gen::Variant(name, v) => s.serialize_newtype_variant("E", 0, name, v),
                Gen::Arr(items) => s.collect_seq(items),
                Gen::Obj(entries) => {
                    let mut m = s.serialize_map(Some(entries.len()))?;
                    for (k, v) in entries {
                        m.serialize_entry(k, v)?;
                    }
                    m.end()
                }
                Gen::Struct(fields) => {
                    let mut m = s.serialize_struct("S", fields.len())?;
                    for (k, v) in fields {
                        m.serialize_field(k, v)?;
                    }
                    m.end()
                }
            }
        }
    }

    struct Generator {
        rng: Rng,
        /// Also produce what only the `Value` route handles.
        exotic: bool,
    }

    impl Generator {
        fn string(&mut self) -> String {
            match self.rng.below(3) {
                0 => self.rng.pick(KEYS).to_owned(),
                1 => {
                    let n = self.rng.below(5);
                    (0..n).map(|_| self.rng.pick(CHARS)).collect()
                }
                _ => format!("{}{}", self.rng.pick(KEYS), self.rng.pick(KEYS)),
            }
        }

        fn key(&mut self) -> GenKey {
            let kinds = if self.exotic { 10 } else { 7 };
            match self.rng.below(kinds) {
                0..=2 => GenKey::Str(self.string()),
                3 => GenKey::U64(self.rng.pick(&[0, 1, 9, 10, 100, u64::MAX])),
                4 => GenKey::I64(self.rng.pick(&[-1, -10, 0, 7, i64::MIN, i64::MAX])),
                5 => match self.rng.below(3) {
                    0 => GenKey::Char(self.rng.pick(CHARS)),
                    1 => GenKey::I128(self.rng.pick(&[i128::MIN, -5, 12, i128::MAX])),
                    _ => GenKey::Variant(self.rng.pick(&["Alpha", "a", "\"q\""])),
                },
                6 => GenKey::Str(self.rng.pick(&["x", "y", "x"]).to_owned()),
                7 => GenKey::Bool(self.rng.below(2) == 0),
                8 => GenKey::F64(self.rng.pick(&[0.5, -0.0, 1e300, f64::NAN])),
                _ => GenKey::Unit,
            }
        }

        fn float(&mut self) -> f64 {
            match self.rng.below(4) {
                0 => self.rng.pick(&[
                    0.0,
                    -0.0,
                    1e300,
                    -1e300,
                    5e-324,
                    f64::MAX,
                    f64::MIN_POSITIVE,
                    0.1,
                    1.0,
                    -2.5,
                    1e16,
                    123_456_789.0,
                ]),
                1 => (self.rng.next() % 1_000_000) as f64 / 1000.0,
                // Non-finite numbers are refused (see `non_finite_numbers_are_refused`).
                _ => Some(f64::from_bits(self.rng.next()))
                    .filter(|v| v.is_finite())
                    .unwrap_or(0.25),
            }
        }

        fn gen(&mut self, depth: usize) -> Gen {
            let kinds = if depth >= 6 { 13 } else { 17 };
            match self.rng.below(kinds) {
                0 => Gen::Null,
                1 => Gen::Bool(self.rng.below(2) == 0),
                2 => Gen::U64(match self.rng.below(3) {
                    0 => u64::MAX,
                    1 => self.rng.next(),
                    _ => self.rng.next() % 1000,
                }),
                3 => Gen::I64(match self.rng.below(3) {
                    0 => i64::MIN,
                    1 => self.rng.next() as i64,
                    _ => -((self.rng.next() % 1000) as i64),
                }),
                4 => Gen::F64(self.float()),
                5 => Gen::F32(match self.rng.below(3) {
                    0 => self.rng.pick(&[0.1, -0.0, 1e-45, f32::MAX, 16_777_217.0]),
                    _ => Some(f32::from_bits(self.rng.next() as u32))
                        .filter(|v| v.is_finite())
                        .unwrap_or(0.5),
                }),
                6 => {
                    let big = self.exotic && self.rng.below(8) == 0;
                    match (big, self.rng.below(2)) {
                        (false, 0) => Gen::I128(i128::from(self.rng.next() as i64)),
                        (false, _) => Gen::U128(u128::from(self.rng.next())),
                        (true, 0) => Gen::I128(i128::MIN),
                        (true, _) => Gen::U128(u128::MAX),
                    }
                }
                7 | 8 => Gen::Str(self.string()),
                9 => Gen::Char(self.rng.pick(CHARS)),
                10 => {
                    let n = self.rng.below(5);
                    Gen::Bytes((0..n).map(|_| self.rng.next() as u8).collect())
                }
                11 => Gen::Some(Box::new(self.gen(depth + 1))),
                12 => Gen::Variant(
                    self.rng.pick(&["V", "w", "\u{1}"]),
                    Box::new(self.gen(depth + 1)),
                ),
                13 | 14 => {
                    let n = self.rng.below(5);
                    Gen::Arr((0..n).map(|_| self.gen(depth + 1)).collect())
                }
                15 => {
                    let n = self.rng.below(7);
                    Gen::Obj((0..n).map(|_| (self.key(), self.gen(depth + 1))).collect())
                }
                _ => {
                    let n = self.rng.below(6);
                    Gen::Struct(
                        (0..n)
                            .map(|_| (self.rng.pick(KEYS), self.gen(depth + 1)))
                            .collect(),
                    )
                }
            }
        }
    }

    #[test]
    fn random_trees_match_the_value_route() {
        let mut reordered = 0;
        for seed in 1..=3000_u64 {
            let mut g = Generator {
                rng: Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1),
                exotic: false,
            };
            // Containers at the top, so most trees have some depth.
            let tree = Gen::Obj(
                (0..1 + g.rng.below(6))
                    .map(|_| (g.key(), g.gen(1)))
                    .collect(),
            );
            let canonical = fast_same(&tree);
            if serde_json::to_string(&tree).unwrap() != canonical {
                reordered += 1;
            }
            // The `Value` of the tree (sorted, deduplicated) goes through too.
            let value = serde_json::to_value(&tree).unwrap();
            assert_eq!(fast_same(&value), canonical);
        }
        let (mut fallbacks, mut errors) = (0, 0);
        for seed in 1..=2000_u64 {
            let mut g = Generator {
                rng: Rng(seed.wrapping_mul(0xd1b5_4a32_d192_ed03) | 1),
                exotic: true,
            };
            let tree = Gen::Arr((0..1 + g.rng.below(4)).map(|_| g.gen(1)).collect());
            if same_as_value(&tree).is_err() {
                errors += 1;
            }
            if fast_only(&tree).is_err() {
                fallbacks += 1;
            }
        }
        // The trees do exercise reordering, and the exotic ones the fallback
        // (with and without errors), but not only it.
        assert!(reordered > 1000, "{reordered}");
        assert!(fallbacks > 100 && fallbacks < 1900, "{fallbacks}");
        assert!(errors > 10 && errors < fallbacks, "{errors} of {fallbacks}");
    }

    #[test]
    fn json_values_match_the_value_route() {
        let v = json!({
            "z": [1, -1, u64::MAX, i64::MIN, 0.5, -0.0, 1e300, 5e-324, null, true, false],
            "a": {"\u{7f}": 1, "🦀": 2, "\u{ffff}": 3, "": 4, "\"": 5, "!": 6, "\u{1}": 7, "0": 8},
            "m": [[], {}, [[{}]], "\u{2028}\u{0}\\/"],
        });
        let expected = concat!(
            r#"{"a":{"":4,"\u0001":7,"!":6,"\"":5,"0":8,"#,
            "\"\u{7f}\":1,\"\u{ffff}\":3,\"🦀\":2},",
            r#""m":[[],{},[[{}]],"#,
            "\"\u{2028}\\u0000\\\\/\"],",
            r#""z":[1,-1,18446744073709551615,-9223372036854775808,0.5,-0.0,1e+300,5e-324,null,true,false]}"#,
        );
        assert_eq!(fast_same(&v), expected);
    }

    #[derive(Debug, Serialize)]
    struct Payment {
        id: usize,
        amount: u64,
    }

    #[derive(Debug, Serialize)]
    #[serde(tag = "type")]
    enum Internal {
        Unit,
        Struct { zeta: u8, alpha: String },
        Newtype(Payment),
    }

    #[derive(Debug, Serialize)]
    #[serde(tag = "t", content = "c")]
    enum Adjacent {
        Unit,
        Tuple(i8, f32),
        Struct { z: bool, a: Option<u8> },
    }

    #[derive(Debug, Serialize)]
    #[serde(untagged)]
    enum Untagged {
        Num(f64),
        Pay(Payment),
        List(Vec<Option<char>>),
    }

    #[derive(Debug, Serialize)]
    enum External {
        Unit,
        Newtype(u32),
        Tuple(u8, String, ()),
        Struct { y: i64, x: Vec<u8> },
    }

    #[derive(Debug, Serialize)]
    struct Unit;

    #[derive(Debug, Serialize)]
    struct Newtype(String);

    #[derive(Debug, Serialize)]
    struct TupleStruct(u8, &'static str);

    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
    enum Color {
        Red,
        Blue,
    }

    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
    struct Id(u64);

    /// Hand-written bytes, as `serde_bytes` writes them.
    #[derive(Debug)]
    struct Bytes(&'static [u8]);

    impl Serialize for Bytes {
        fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
            s.serialize_bytes(self.0)
        }
    }

    #[derive(Debug, Serialize)]
    struct Everything {
        zulu: u8,
        #[serde(rename = "Alpha")]
        alpha: i16,
        #[serde(rename = "ñ")]
        enye: char,
        #[serde(skip_serializing_if = "Option::is_none")]
        skipped: Option<u8>,
        present: Option<Option<u8>>,
        absent: Option<u8>,
        f32s: Vec<f32>,
        f64s: Vec<f64>,
        tuple: (u8, String, (bool, f32)),
        vec_u8: Vec<u8>,
        bytes: Bytes,
        unit: (),
        unit_struct: Unit,
        newtype: Newtype,
        tuple_struct: TupleStruct,
        externals: Vec<External>,
        internals: Vec<Internal>,
        adjacents: Vec<Adjacent>,
        untagged: Vec<Untagged>,
        by_u64: HashMap<u64, &'static str>,
        by_i32: BTreeMap<i32, bool>,
        by_color: HashMap<Color, u8>,
        by_id: HashMap<Id, u8>,
        by_char: HashMap<char, u8>,
        by_i128: BTreeMap<i128, u8>,
        #[serde(flatten)]
        extra: HashMap<String, Value>,
        i128: i128,
        u128: u128,
    }

    fn everything() -> Everything {
        Everything {
            zulu: 1,
            alpha: -2,
            enye: '🦀',
            skipped: None,
            present: Some(None),
            absent: None,
            f32s: vec![0.1, -0.0, 1.5, 3.402_823_5e38, 1e-45],
            f64s: vec![0.1, -0.0, 1e300, 5e-324, 1e21, 1e-7],
            tuple: (3, "t\u{1}".into(), (true, 2.25)),
            vec_u8: vec![0, 255, 7],
            bytes: Bytes(b"\x00\xffhi"),
            unit: (),
            unit_struct: Unit,
            newtype: Newtype("n\"ew".into()),
            tuple_struct: TupleStruct(9, "ts"),
            externals: vec![
                External::Unit,
                External::Newtype(4),
                External::Tuple(1, "x".into(), ()),
                External::Struct {
                    y: -1,
                    x: vec![1, 2],
                },
            ],
            internals: vec![
                Internal::Unit,
                Internal::Struct {
                    zeta: 1,
                    alpha: "a".into(),
                },
                Internal::Newtype(Payment { id: 3, amount: 4 }),
            ],
            adjacents: vec![
                Adjacent::Unit,
                Adjacent::Tuple(-3, 0.3),
                Adjacent::Struct { z: false, a: None },
            ],
            untagged: vec![
                Untagged::Num(2.0),
                Untagged::Pay(Payment { id: 1, amount: 2 }),
                Untagged::List(vec![Some('x'), None]),
            ],
            by_u64: [
                (10, "ten"),
                (9, "nine"),
                (u64::MAX, "max"),
                (100, "hundred"),
            ]
            .into_iter()
            .collect(),
            by_i32: [(-1, true), (-10, false), (2, true), (10, false)]
                .into_iter()
                .collect(),
            by_color: [(Color::Red, 1), (Color::Blue, 2)].into_iter().collect(),
            by_id: [(Id(2), 1), (Id(10), 2)].into_iter().collect(),
            by_char: [('b', 1), ('a', 2), ('\u{1}', 3), ('"', 4)]
                .into_iter()
                .collect(),
            by_i128: [(i128::MAX, 1), (i128::MIN, 2), (-1, 3)]
                .into_iter()
                .collect(),
            // "zulu" is also a field: the flattened (later) one wins.
            extra: [
                ("zulu".to_owned(), json!("flattened")),
                (
                    "mid".to_owned(),
                    json!({"b": 1, "a": [2, {"d": 3, "c": 4}]}),
                ),
                ("".to_owned(), json!(null)),
            ]
            .into_iter()
            .collect(),
            i128: -5,
            u128: u128::from(u64::MAX),
        }
    }

    #[test]
    fn derived_types_match_the_value_route() {
        let e = everything();
        let s = fast_same(&e);
        assert!(
            s.starts_with(r#"{"":null,"Alpha":-2,"absent":null,"adjacents":"#),
            "{s}"
        );
        assert!(s.contains(r#""zulu":"flattened""#), "{s}");
        assert!(
            s.contains(r#""f32s":[0.10000000149011612,-0.0,1.5,"#),
            "{s}"
        );
        fast_same(&Payment { id: 1, amount: 2 });
        fast_same(&(1, "two", [3.0], Some(Unit), None::<u8>));
        fast_same(&External::Struct {
            y: 0,
            x: Vec::new(),
        });
        fast_same(&Color::Blue);
        fast_same(&Id(7));
        fast_same(&'\u{7f}');
        fast_same(&Bytes(b""));
        fast_same(&Vec::<Value>::new());
        fast_same(&HashMap::<String, u8>::new());
        let many: HashMap<String, usize> = (0..500)
            .map(|i| (format!("k{}", i * 7919 % 500), i))
            .collect();
        fast_same(&many);
        let many_u64: HashMap<u64, usize> = (0..=120).map(|i| (i, 0)).collect();
        // Integer keys sort as strings: "0" < "1" < "10" < "100" < "101" …
        assert!(fast_same(&many_u64).starts_with(r#"{"0":0,"1":0,"10":0,"100":0,"101":0,"#));
    }

    /// A map writing the same key more than once.
    #[derive(Debug)]
    struct Repeats(Vec<(&'static str, i32)>);

    impl Serialize for Repeats {
        fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
            let mut m = s.serialize_map(None)?;
            for (k, v) in &self.0 {
                m.serialize_entry(k, v)?;
            }
            m.end()
        }
    }

    #[test]
    fn repeated_keys_keep_the_last_value() {
        assert_eq!(
            fast_same(&Repeats(vec![("b", 1), ("a", 2), ("b", 3)])),
            r#"{"a":2,"b":3}"#
        );
        assert_eq!(fast_same(&Repeats(vec![("a", 1), ("a", 2)])), r#"{"a":2}"#);
        assert_eq!(
            fast_same(&Repeats(vec![
                ("a", 1),
                ("b", 2),
                ("a", 3),
                ("a", 4),
                ("c", 5),
                ("b", 6)
            ])),
            r#"{"a":4,"b":6,"c":5}"#
        );
        assert_eq!(
            fast_same(&Repeats(vec![("x", 1), ("x", 2), ("x", 3)])),
            r#"{"x":3}"#
        );
    }

    #[derive(Debug, Serialize)]
    struct WithRaw {
        b: u8,
        raw: Box<serde_json::value::RawValue>,
    }

    /// `serde_json`'s private magic struct, hand-written.
    #[derive(Debug)]
    struct Magic(&'static str, &'static str);

    impl Serialize for Magic {
        fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
            let mut st = s.serialize_struct(self.0, 1)?;
            st.serialize_field(self.0, self.1)?;
            st.end()
        }
    }

    #[derive(Debug)]
    struct BadOrder(bool);

    impl Serialize for BadOrder {
        fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
            let mut m = s.serialize_map(None)?;
            m.serialize_key("a")?;
            if self.0 {
                // Two keys in a row: `to_value` keeps the second.
                m.serialize_key("b")?;
                m.serialize_value(&1)?;
            }
            // Dangling key: `to_value` drops it.
            m.serialize_key("c")?;
            m.end()
        }
    }

    #[test]
    fn what_the_value_route_decides() {
        let raw =
            serde_json::value::RawValue::from_string(r#"{"b": 1, "a": [1, 2.50]}"#.into()).unwrap();
        assert_eq!(falls_back(&raw).unwrap(), r#"{"a":[1,2.5],"b":1}"#);
        let with_raw = WithRaw { b: 1, raw };
        assert_eq!(
            falls_back(&with_raw).unwrap(),
            r#"{"b":1,"raw":{"a":[1,2.5],"b":1}}"#
        );
        assert_eq!(
            falls_back(&Magic("$serde_json::private::RawValue", "[3, 1]")).unwrap(),
            "[3,1]"
        );
        // Without `arbitrary_precision`, not magic to `to_value`: a plain struct.
        assert_eq!(
            falls_back(&Magic("$serde_json::private::Number", "1.50")).unwrap(),
            r#"{"$serde_json::private::Number":"1.50"}"#
        );

        assert_eq!(falls_back(&u128::MAX).unwrap_err(), "number out of range");
        assert_eq!(falls_back(&i128::MIN).unwrap_err(), "number out of range");
        assert_eq!(
            falls_back(&vec![Some(u128::MAX)]).unwrap_err(),
            "number out of range"
        );
        assert_eq!(fast_same(&u128::from(u64::MAX)), "18446744073709551615");
        assert_eq!(fast_same(&i128::from(i64::MIN)), "-9223372036854775808");

        let by_bool: BTreeMap<bool, u8> = [(true, 1), (false, 2)].into_iter().collect();
        assert_eq!(falls_back(&by_bool).unwrap(), r#"{"false":2,"true":1}"#);
        let by_tuple: HashMap<(u8, u8), u8> = [((1, 2), 3)].into_iter().collect();
        assert_eq!(falls_back(&by_tuple).unwrap_err(), "key must be a string");
        let by_option: BTreeMap<Option<u8>, u8> = [(Some(1), 3)].into_iter().collect();
        assert_eq!(falls_back(&by_option).unwrap_err(), "key must be a string");
        let by_unit: BTreeMap<(), u8> = [((), 3)].into_iter().collect();
        assert_eq!(falls_back(&by_unit).unwrap_err(), "key must be a string");
        falls_back(&Gen::Obj(vec![
            (GenKey::F64(0.5), Gen::Null),
            (GenKey::F64(1e300), Gen::Null),
        ]))
        .unwrap();
        falls_back(&Gen::Obj(vec![(GenKey::F64(f64::NAN), Gen::Null)])).unwrap_err();

        assert_eq!(falls_back(&BadOrder(false)).unwrap(), "{}");
        assert_eq!(falls_back(&BadOrder(true)).unwrap(), r#"{"b":1}"#);
    }

    /// Fails to serialize, like a user's `Serialize` impl may.
    #[derive(Debug)]
    struct Boom;

    impl Serialize for Boom {
        fn serialize<S: Serializer>(&self, _s: S) -> Result<S::Ok, S::Error> {
            Err(S::Error::custom("boom"))
        }
    }

    #[test]
    fn serialize_errors_are_codec_errors() {
        #[derive(Debug, Serialize)]
        struct Outer {
            a: u8,
            nested: Vec<BTreeMap<&'static str, Boom>>,
        }
        let outer = Outer {
            a: 1,
            nested: vec![[("k", Boom)].into_iter().collect()],
        };
        assert!(
            matches!(fast_only(&outer), Err(FastError::Custom(ref e)) if e.to_string() == "boom")
        );
        for result in [to_vec(&outer), to_vec(&Boom), to_vec(&Some(Boom))] {
            match result {
                Err(Error::Codec { source }) => assert_eq!(source.to_string(), "boom"),
                other => panic!("{other:?}"),
            }
        }
        assert_eq!(same_as_value(&outer).unwrap_err(), "boom");
        // The same error type as before (a `serde_json::Error`).
        match crate::strategy::canonical_json(&outer) {
            Err(Error::Codec { source }) => assert!(source.is::<serde_json::Error>()),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn reentrant_and_repeated_calls_share_buffers_safely() {
        /// Asks for canonical JSON while being serialized.
        #[derive(Debug)]
        struct Nested;

        impl Serialize for Nested {
            fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                let inner = to_vec(&json!({"b": 1, "a": 2})).map_err(S::Error::custom)?;
                s.serialize_str(std::str::from_utf8(&inner).map_err(S::Error::custom)?)
            }
        }
        let both = Repeats(vec![("z", 1), ("y", 2)]);
        for _ in 0..3 {
            assert_eq!(
                fast_same(&(Nested, &both)),
                r#"["{\"a\":2,\"b\":1}",{"y":2,"z":1}]"#
            );
        }
        // A large value does not stay in the thread's buffers.
        let big: BTreeMap<String, u8> = (0..20_000).map(|i| (format!("{i}"), 0)).collect();
        let fingerprint = with_canonical(&big, crate::Fingerprint::of_bytes).unwrap();
        assert_eq!(
            fingerprint,
            crate::Fingerprint::of_bytes(fast_same(&big).as_bytes())
        );
        let kept = BUFFERS.with(|c| {
            let canon = c.borrow();
            canon.out.capacity() + canon.scratch.keys.capacity() + canon.scratch.tmp.capacity()
        });
        assert!(kept <= KEEP_BYTES, "{kept}");
    }

    #[test]
    fn a_panicking_serialize_leaves_nothing_behind() {
        /// Writes part of an object, then panics.
        struct Bomb;

        impl Serialize for Bomb {
            fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                use serde::ser::SerializeMap;
                let mut map = s.serialize_map(None)?;
                map.serialize_entry("half", "written")?;
                panic!("boom");
            }
        }
        let before = to_vec(&json!({"a": 1})).unwrap();
        assert!(std::panic::catch_unwind(|| to_vec(&Bomb)).is_err());
        // The same thread's next call starts from empty buffers.
        assert_eq!(to_vec(&json!({"a": 1})).unwrap(), before);
        assert_eq!(before, br#"{"a":1}"#);
    }
}
