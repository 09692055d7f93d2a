//! The canonical JSON of a JSON *text*, without loss.
//!
//! Reading a text into a `serde_json::Value` and writing that canonically loses
//! what a handler reading the text can still tell apart: numbers past `f64`'s
//! precision, and integers past 64 bits, round to the nearest `f64`; of a
//! member name repeated in one object only the last value is kept. This module
//! reads the text itself, so the canonical form changes only what JSON does
//! not mean (see [`canonical_json_text`]), and for every text the `Value` route
//! reads without loss it writes the same bytes that route writes.

use std::cmp::Ordering;

use crate::error::Error;

/// How deep arrays and objects may nest (`serde_json`'s own limit).
const MAX_DEPTH: usize = 128;

/// The canonical JSON of a JSON text: what a handler parsing the text can tell
/// apart stays apart, and nothing else does.
///
/// - Whitespace between tokens is dropped.
/// - Object members are sorted by name (the bytes of the unescaped name, as
///   [`canonical_json`](crate::canonical_json) sorts them). A name repeated in
///   one object refuses the text: parsers disagree on which of its values
///   counts (the first, the last, or an error), so it must equal neither
///   object without the repetition.
/// - Strings are unescaped and escaped again the way `serde_json` writes them
///   (`"\u0041"` and `"A"` are one string).
/// - Numbers keep their exact decimal value, never rounded through `f64`, and
///   whether they are written as an integer: `1` is not `1.0` (a handler
///   reading an integer type takes one and refuses the other), `-0` is not `0`,
///   `1.0`, `1.00`, `10e-1` and `1e0` are one number (written `1.0`), and
///   `0.1` differs from `0.10000000000000000001`, as `9007199254740993.0` from
///   `9007199254740992.0` and `18446744073709551617` from
///   `18446744073709551616`. A number an `f64` holds exactly as its shortest
///   form is written as `serde_json` writes that `f64` (`1.5`, `1e+300`); any
///   other in scientific form with every digit (`1.00000000000000000001e0`).
///
/// The output is the same bytes [`canonical_json`](crate::canonical_json)
/// gives for the `serde_json::Value` of the text whenever that `Value` lost
/// nothing, so fingerprints of such texts are unchanged.
///
/// ```
/// use idempotency_core::canonical_json_text;
///
/// let a = canonical_json_text(br#"{ "b": [1, 2.50], "a": "\u00e9" }"#)?;
/// assert_eq!(a, r#"{"a":"é","b":[1,2.5]}"#);
/// // Digits past f64's precision count:
/// assert_ne!(
///     canonical_json_text(b"0.1")?,
///     canonical_json_text(b"0.10000000000000000001")?,
/// );
/// assert_ne!(canonical_json_text(b"1")?, canonical_json_text(b"1.0")?);
/// // A repeated member name is refused.
/// assert!(canonical_json_text(br#"{"a": 1, "a": 2}"#).is_err());
/// # Ok::<(), idempotency_core::Error>(())
/// ```
///
/// # Errors
/// [`Error::Codec`] when the text is not JSON (or not UTF-8), nests deeper
/// than 128 levels, repeats a member name in one object, or holds a number
/// whose exponent does not fit 64 bits.
pub fn canonical_json_text(text: &[u8]) -> Result<String, Error> {
    let mut reader = Reader {
        text,
        at: 0,
        depth: 0,
    };
    let mut out = Vec::with_capacity(text.len());
    reader
        .value(&mut out)
        .and_then(|()| {
            reader.skip_whitespace();
            match reader.peek() {
                None => Ok(()),
                Some(_) => Err(Refused::Syntax(reader.at)),
            }
        })
        .map_err(Refused::into_error)?;
    // Only ASCII tokens and `serde_json`'s strings were written.
    String::from_utf8(out).map_err(|e| Error::Codec { source: e.into() })
}

/// Why a text has no canonical form.
#[derive(Debug)]
enum Refused {
    /// Not JSON at this byte.
    Syntax(usize),
    /// A member name repeated in one object.
    Repeated(String),
    /// Nested deeper than [`MAX_DEPTH`].
    TooDeep,
    /// A number whose exponent does not fit an `i64`.
    Exponent(usize),
}

impl Refused {
    fn into_error(self) -> Error {
        let message = match self {
            Refused::Syntax(at) => format!("not a JSON text (at byte {at})"),
            Refused::Repeated(name) => format!(
                "the member name {name:?} is repeated in one object, which parsers read \
                 differently: the text has no canonical form"
            ),
            Refused::TooDeep => format!("JSON nested deeper than {MAX_DEPTH} levels"),
            Refused::Exponent(at) => {
                format!("a JSON number's exponent is out of range (at byte {at})")
            }
        };
        Error::Codec {
            source: message.into(),
        }
    }
}

/// One object member written to the output: `"name":value` at `start..end`.
#[derive(Debug)]
struct Member {
    name: String,
    start: usize,
    end: usize,
}

/// A cursor over the text.
#[derive(Debug)]
struct Reader<'a> {
    text: &'a [u8],
    at: usize,
    depth: usize,
}

impl Reader<'_> {
    fn peek(&self) -> Option<u8> {
        self.text.get(self.at).copied()
    }

    fn skip_whitespace(&mut self) {
        while matches!(self.peek(), Some(b' ' | b'\t' | b'\n' | b'\r')) {
            self.at += 1;
        }
    }

    /// Consumes `byte` (after whitespace), or refuses the text.
    fn expect(&mut self, byte: u8) -> Result<(), Refused> {
        self.skip_whitespace();
        if self.peek() == Some(byte) {
            self.at += 1;
            Ok(())
        } else {
            Err(Refused::Syntax(self.at))
        }
    }

    fn value(&mut self, out: &mut Vec<u8>) -> Result<(), Refused> {
        self.skip_whitespace();
        match self.peek() {
            Some(b'{') => self.nested(out, Self::object),
            Some(b'[') => self.nested(out, Self::array),
            Some(b'"') => {
                let s = self.string()?;
                write_string(out, &s)
            }
            Some(b't') => self.literal(out, b"true"),
            Some(b'f') => self.literal(out, b"false"),
            Some(b'n') => self.literal(out, b"null"),
            Some(b'-' | b'0'..=b'9') => self.number(out),
            _ => Err(Refused::Syntax(self.at)),
        }
    }

    fn nested(
        &mut self,
        out: &mut Vec<u8>,
        read: fn(&mut Self, &mut Vec<u8>) -> Result<(), Refused>,
    ) -> Result<(), Refused> {
        if self.depth == MAX_DEPTH {
            return Err(Refused::TooDeep);
        }
        self.depth += 1;
        self.at += 1;
        read(self, out)?;
        self.depth -= 1;
        Ok(())
    }

    fn literal(&mut self, out: &mut Vec<u8>, word: &[u8]) -> Result<(), Refused> {
        if !self.text[self.at..].starts_with(word) {
            return Err(Refused::Syntax(self.at));
        }
        self.at += word.len();
        out.extend_from_slice(word);
        Ok(())
    }

    /// After `[`.
    fn array(&mut self, out: &mut Vec<u8>) -> Result<(), Refused> {
        out.push(b'[');
        self.skip_whitespace();
        if self.peek() == Some(b']') {
            self.at += 1;
            out.push(b']');
            return Ok(());
        }
        loop {
            self.value(out)?;
            self.skip_whitespace();
            match self.peek() {
                Some(b',') => out.push(b','),
                Some(b']') => break,
                _ => return Err(Refused::Syntax(self.at)),
            }
            self.at += 1;
        }
        self.at += 1;
        out.push(b']');
        Ok(())
    }

    /// After `{`.
    fn object(&mut self, out: &mut Vec<u8>) -> Result<(), Refused> {
        out.push(b'{');
        let body = out.len();
        let mut members = Vec::new();
        self.skip_whitespace();
        if self.peek() == Some(b'}') {
            self.at += 1;
            out.push(b'}');
            return Ok(());
        }
        loop {
            self.skip_whitespace();
            if self.peek() != Some(b'"') {
                return Err(Refused::Syntax(self.at));
            }
            let name = self.string()?;
            if !members.is_empty() {
                out.push(b',');
            }
            let start = out.len();
            write_string(out, &name)?;
            out.push(b':');
            self.expect(b':')?;
            self.value(out)?;
            members.push(Member {
                name,
                start,
                end: out.len(),
            });
            self.skip_whitespace();
            match self.peek() {
                Some(b',') => self.at += 1,
                Some(b'}') => break,
                _ => return Err(Refused::Syntax(self.at)),
            }
        }
        self.at += 1;
        sort_members(out, body, &mut members)?;
        out.push(b'}');
        Ok(())
    }

    /// A string token, unescaped (`serde_json` checks escapes, surrogates,
    /// control characters and UTF-8).
    fn string(&mut self) -> Result<String, Refused> {
        let start = self.at;
        let mut i = start + 1;
        loop {
            match self.text.get(i) {
                None => return Err(Refused::Syntax(i)),
                Some(b'\\') => i += 2,
                Some(b'"') => break,
                Some(_) => i += 1,
            }
        }
        self.at = i + 1;
        serde_json::from_slice(&self.text[start..self.at]).map_err(|_| Refused::Syntax(start))
    }

    /// A number token (RFC 8259 §6), written canonically.
    fn number(&mut self, out: &mut Vec<u8>) -> Result<(), Refused> {
        let start = self.at;
        let digits = |r: &mut Self| {
            let from = r.at;
            while matches!(r.peek(), Some(b'0'..=b'9')) {
                r.at += 1;
            }
            if r.at == from {
                Err(Refused::Syntax(r.at))
            } else {
                Ok(())
            }
        };
        if self.peek() == Some(b'-') {
            self.at += 1;
        }
        match self.peek() {
            Some(b'0') => self.at += 1,
            Some(b'1'..=b'9') => digits(self)?,
            _ => return Err(Refused::Syntax(self.at)),
        }
        let mut integer = true;
        if self.peek() == Some(b'.') {
            integer = false;
            self.at += 1;
            digits(self)?;
        }
        if matches!(self.peek(), Some(b'e' | b'E')) {
            integer = false;
            self.at += 1;
            if matches!(self.peek(), Some(b'+' | b'-')) {
                self.at += 1;
            }
            digits(self)?;
        }
        let literal = &self.text[start..self.at];
        if integer {
            // The grammar leaves one way to write an integer: as written.
            out.extend_from_slice(literal);
            return Ok(());
        }
        write_decimal(out, literal).ok_or(Refused::Exponent(start))
    }
}

/// Puts the members written at `out[body..]` in name order, refusing a
/// repeated name.
fn sort_members(out: &mut Vec<u8>, body: usize, members: &mut [Member]) -> Result<(), Refused> {
    let by_name = |a: &Member, b: &Member| a.name.as_bytes().cmp(b.name.as_bytes());
    if members
        .windows(2)
        .all(|w| by_name(&w[0], &w[1]) == Ordering::Less)
    {
        return Ok(());
    }
    members.sort_unstable_by(by_name);
    if let Some(w) = members.windows(2).find(|w| w[0].name == w[1].name) {
        return Err(Refused::Repeated(w[0].name.clone()));
    }
    let written = out.split_off(body);
    for (i, member) in members.iter().enumerate() {
        if i > 0 {
            out.push(b',');
        }
        out.extend_from_slice(&written[member.start - body..member.end - body]);
    }
    Ok(())
}

fn write_string(out: &mut Vec<u8>, s: &str) -> Result<(), Refused> {
    // Writing into a `Vec` does not fail.
    serde_json::to_writer(out, s).map_err(|_| Refused::Syntax(0))
}

/// A decimal's exact value: `digits × 10^exponent`, `digits` without leading
/// or trailing zeros (empty for zero).
#[derive(Debug, PartialEq, Eq)]
struct Exact {
    negative: bool,
    digits: Vec<u8>,
    exponent: i64,
}

impl Exact {
    /// The value of a JSON number literal (or of `serde_json`'s rendering of
    /// an `f64`, which has the same shape); `None` when its exponent does not
    /// fit.
    fn of(literal: &[u8]) -> Option<Exact> {
        let (negative, rest) = match literal.split_first() {
            Some((b'-', rest)) => (true, rest),
            _ => (false, literal),
        };
        let (mantissa, exponent) = match rest.iter().position(|&b| b == b'e' || b == b'E') {
            Some(e) => (&rest[..e], parse_exponent(&rest[e + 1..])?),
            None => (rest, 0),
        };
        let (whole, fraction) = match mantissa.iter().position(|&b| b == b'.') {
            Some(dot) => (&mantissa[..dot], &mantissa[dot + 1..]),
            None => (mantissa, &[][..]),
        };
        let mut digits: Vec<u8> = whole.iter().chain(fraction).copied().collect();
        let mut exponent = exponent.checked_sub(i64::try_from(fraction.len()).ok()?)?;
        let trailing = digits.iter().rev().take_while(|&&d| d == b'0').count();
        digits.truncate(digits.len() - trailing);
        exponent = exponent.checked_add(i64::try_from(trailing).ok()?)?;
        let leading = digits.iter().take_while(|&&d| d == b'0').count();
        digits.drain(..leading);
        if digits.is_empty() {
            exponent = 0;
        }
        Some(Exact {
            negative,
            digits,
            exponent,
        })
    }

    /// Scientific form with every digit: `-d.ddde<n>` (`d.0e<n>` for one
    /// digit). Only for values other than zero.
    fn write_scientific(&self, out: &mut Vec<u8>) -> Option<()> {
        let (first, rest) = self.digits.split_first()?;
        let power = self.exponent.checked_add(i64::try_from(rest.len()).ok()?)?;
        if self.negative {
            out.push(b'-');
        }
        out.push(*first);
        out.push(b'.');
        if rest.is_empty() {
            out.push(b'0');
        } else {
            out.extend_from_slice(rest);
        }
        out.push(b'e');
        out.extend_from_slice(power.to_string().as_bytes());
        Some(())
    }
}

/// `[+-]digits` as an `i64`, `None` when it does not fit.
fn parse_exponent(text: &[u8]) -> Option<i64> {
    let (negative, digits) = match text.split_first() {
        Some((b'-', rest)) => (true, rest),
        Some((b'+', rest)) => (false, rest),
        _ => (false, text),
    };
    let mut value: i64 = 0;
    for &d in digits {
        value = value.checked_mul(10)?.checked_add(i64::from(d - b'0'))?;
    }
    Some(if negative { -value } else { value })
}

/// Writes a non-integer literal: as `serde_json` writes the `f64` it reads as,
/// when that rendering has exactly the literal's value; else every digit in
/// scientific form. `None` when an exponent does not fit.
fn write_decimal(out: &mut Vec<u8>, literal: &[u8]) -> Option<()> {
    let exact = Exact::of(literal)?;
    // A JSON number literal is ASCII, and Rust reads it correctly rounded.
    let float: f64 = std::str::from_utf8(literal).ok()?.parse().ok()?;
    if float.is_finite() {
        let mut rendered = Vec::new();
        serde_json::to_writer(&mut rendered, &float).ok()?;
        if Exact::of(&rendered).as_ref() == Some(&exact) {
            out.extend_from_slice(&rendered);
            return Some(());
        }
    }
    exact.write_scientific(out)
}

#[cfg(test)]
mod tests {
    use serde_json::Value;

    use super::*;

    fn canon(text: &str) -> String {
        canonical_json_text(text.as_bytes()).unwrap_or_else(|e| panic!("{text}: {e}"))
    }

    fn refused(text: &[u8]) -> String {
        match canonical_json_text(text) {
            Err(Error::Codec { source }) => source.to_string(),
            other => panic!(
                "{:?} was not refused: {other:?}",
                String::from_utf8_lossy(text)
            ),
        }
    }

    /// The canonical form of the text's `serde_json::Value`.
    fn value_route(text: &str) -> String {
        let value: Value = serde_json::from_str(text).unwrap();
        crate::canonical_json(&value).unwrap()
    }

    #[test]
    fn order_whitespace_and_escapes_do_not_count() {
        assert_eq!(
            canon(" { \"b\" : [ 1 , { \"d\":0, \"c\":1 } ],\n\t\"a\": null }\r\n"),
            r#"{"a":null,"b":[1,{"c":1,"d":0}]}"#
        );
        assert_eq!(canon(r#""\u0041\/\u00e9\ud83e\udd80""#), "\"A/é🦀\"");
        assert_eq!(canon(r#""\u0001\n\"\\""#), r#""\u0001\n\"\\""#);
        assert_eq!(canon("[]"), "[]");
        assert_eq!(canon("{ }"), "{}");
        assert_eq!(canon("true"), "true");
        assert_eq!(
            canon(r#"{"é":1,"e":2,"🦀":3,"\u007f":4,"":5}"#),
            "{\"\":5,\"e\":2,\"\u{7f}\":4,\"é\":1,\"🦀\":3}"
        );
    }

    #[test]
    fn numbers_keep_their_exact_value_and_their_kind() {
        let same = [
            ("1.0", "1.0"),
            ("1.00", "1.0"),
            ("10e-1", "1.0"),
            ("1e0", "1.0"),
            ("1E+0", "1.0"),
            ("0.1", "0.1"),
            ("2.50", "2.5"),
            ("1e300", "1e+300"),
            ("-0.0", "-0.0"),
            ("-0e7", "-0.0"),
            ("0.0e-3", "0.0"),
            ("18446744073709551617", "18446744073709551617"),
            ("-0", "-0"),
            ("123", "123"),
            ("0.10000000000000000001", "1.0000000000000000001e-1"),
            ("9007199254740993.0", "9.007199254740993e15"),
            ("1e400", "1.0e400"),
            ("-1e-400", "-1.0e-400"),
            ("12.5e-2000", "1.25e-1999"),
            ("1e9999999999999999", "1.0e9999999999999999"),
        ];
        for (literal, canonical) in same {
            assert_eq!(canon(literal), canonical, "{literal}");
            assert_eq!(canon(&format!("[{literal}]")), format!("[{canonical}]"));
        }
        let apart = [
            ("1", "1.0"),
            ("0", "-0"),
            ("0.0", "-0.0"),
            ("0", "0.0"),
            ("0.1", "0.10000000000000000001"),
            ("9007199254740992.0", "9007199254740993.0"),
            ("18446744073709551616", "18446744073709551617"),
            ("100000000000000000000", "1e20"),
            ("1e400", "1e401"),
            ("1e-400", "0.0"),
            ("1.5", "-1.5"),
        ];
        for (a, b) in apart {
            assert_ne!(canon(a), canon(b), "{a} vs {b}");
        }
        let message = refused(b"1e99999999999999999999");
        assert!(message.contains("exponent is out of range"), "{message}");
    }

    #[test]
    fn a_repeated_member_name_is_refused() {
        for text in [
            r#"{"a":1,"a":2}"#,
            r#"{"a":1,"b":2,"a":1}"#,
            r#"[0, {"x": {"a": 1, "\u0061": 1}}]"#,
            r#"{"b":1,"a":2,"b":3}"#,
        ] {
            let message = refused(text.as_bytes());
            assert!(message.contains("is repeated"), "{text}: {message}");
        }
        // The same name in two objects is no repetition.
        assert_eq!(
            canon(r#"{"a":{"a":1},"b":{"a":2}}"#),
            r#"{"a":{"a":1},"b":{"a":2}}"#
        );
    }

    #[test]
    fn what_is_not_json_is_refused() {
        for text in [
            &b""[..],
            b" ",
            b"01",
            b"1.",
            b".5",
            b"+1",
            b"-",
            b"1e",
            b"1e+",
            b"[1,]",
            b"{\"a\":1,}",
            b"{\"a\" 1}",
            b"{a:1}",
            b"[1 2]",
            b"tru",
            b"nul",
            b"\"open",
            b"\"\\ud800\"",
            b"\"\\x\"",
            b"\"tab\there\"",
            b"\"\xff\"",
            b"\xef\xbb\xbf{}",
            b"{} {}",
            b"[1]]",
            b"NaN",
        ] {
            let message = refused(text);
            assert!(message.contains("not a JSON text"), "{message}");
        }
        let deep_ok = format!("{}{}", "[".repeat(MAX_DEPTH), "]".repeat(MAX_DEPTH));
        assert_eq!(canon(&deep_ok), deep_ok);
        let too_deep = format!("{}{}", "[".repeat(MAX_DEPTH + 1), "]".repeat(MAX_DEPTH + 1));
        assert!(refused(too_deep.as_bytes()).contains("deeper"));
    }

    // xorshift64*, seeded: reproducible random documents (the one the
    // typed canonicalizer's tests use).
    use crate::canonical::tests::Rng;

    /// Numbers a `Value` holds without loss, in several spellings.
    const NUMBERS: &[&str] = &[
        "0",
        "-1",
        "7",
        "18446744073709551615",
        "-9223372036854775808",
        "0.5",
        "-0.0",
        "0.0",
        "1e300",
        "1E-7",
        "2.50",
        "10e-1",
        "123.456",
        "5e-324",
        "1.7976931348623157e308",
        "0.1",
        "100.0",
    ];
    const NAMES: &[&str] = &["a", "b", "", "é", "🦀", "\\u0041", "\\\"", "aa", "Z", "\\n"];
    const SPACE: &[&str] = &["", " ", "\n", "\t ", "\r\n"];

    /// A random document as text, each object's members in a random order,
    /// with random whitespace; `order` picks the permutation.
    fn document(rng: &mut Rng, depth: usize, order: u64) -> String {
        let ws = |rng: &mut Rng| rng.pick(SPACE).to_owned();
        match rng.below(if depth > 4 { 3 } else { 5 }) {
            0 => rng.pick(NUMBERS).to_owned(),
            1 => format!("\"{}\"", rng.pick(NAMES)),
            2 => rng.pick(&["true", "false", "null"]).to_owned(),
            3 => {
                let n = rng.below(4);
                let items: Vec<String> = (0..n).map(|_| document(rng, depth + 1, order)).collect();
                format!("[{}{}]", items.join(&format!(",{}", ws(rng))), ws(rng))
            }
            _ => {
                // Distinct names (the decoded forms of NAMES are distinct).
                let mut names: Vec<&str> = NAMES.to_vec();
                names.truncate(rng.below(NAMES.len()));
                let mut members: Vec<String> = names
                    .iter()
                    .map(|name| {
                        let value = document(rng, depth + 1, order);
                        format!("\"{name}\"{}:{}{value}", ws(rng), ws(rng))
                    })
                    .collect();
                let mut shuffle = Rng(order | 1);
                for i in (1..members.len()).rev() {
                    members.swap(i, shuffle.below(i + 1));
                }
                format!("{{{}{}}}", ws(rng), members.join(","))
            }
        }
    }

    #[test]
    fn lossless_texts_match_the_value_route_in_any_order() {
        for seed in 1..=2000_u64 {
            let text = document(&mut Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1), 0, 1);
            let canonical = canon(&text);
            assert_eq!(canonical, value_route(&text), "{text}");
            // The same document with its members in another order: the same form.
            let other = document(
                &mut Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1),
                0,
                seed,
            );
            assert_eq!(canon(&other), canonical, "{text} vs {other}");
        }
    }

    #[test]
    fn one_digit_more_or_less_is_another_number() {
        let mut rng = Rng(0x5eed);
        for _ in 0..2000 {
            let len = 1 + rng.below(40);
            let mut digits: Vec<u8> = (0..len).map(|_| b'0' + rng.below(10) as u8).collect();
            digits[0] = b'1' + rng.below(9) as u8;
            let digits = String::from_utf8(digits).unwrap();
            let exp = rng.below(40) as i64 - 20;
            // The same value written three ways: equal.
            let a = format!("{digits}e{exp}");
            let b = format!("{}.{}e{}", &digits[..1], &digits[1..], exp + len as i64 - 1);
            let c = format!("{digits}000e{}", exp - 3);
            let b = if len == 1 {
                format!("{digits}.0e{exp}")
            } else {
                b
            };
            assert_eq!(canon(&a), canon(&b), "{a} vs {b}");
            assert_eq!(canon(&a), canon(&c), "{a} vs {c}");
            // Any change of the last digit: different.
            let mut changed = digits.clone().into_bytes();
            let last = changed.len() - 1;
            changed[last] = if changed[last] == b'9' {
                b'8'
            } else {
                changed[last] + 1
            };
            let d = format!("{}e{exp}", String::from_utf8(changed).unwrap());
            assert_ne!(canon(&a), canon(&d), "{a} vs {d}");
            // And its canonical form reads back as the same number.
            assert_eq!(canon(&canon(&a)), canon(&a));
        }
    }
}
