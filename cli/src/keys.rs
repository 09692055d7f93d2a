//! How the tool names a record, printing and reading alike.
//!
//! Everywhere it prints a key (tables, JSON's `key`, messages), the tool
//! prints the record key's encoded form, [`RecordKey::encode`]: the
//! namespace with `%`, `:`, `{`, `}` and control characters percent-escaped,
//! a `:`, and the id as stored, verbatim. It is the form stores and
//! `RecordKey::encode` give, and `--key` reads it back whatever the key
//! holds (spaces, `%`, `:`, `|`, non-ASCII; a digest id stays a digest).
//! A record can also be named by `NAMESPACE ID`, `NAMESPACE --id ID` (an id
//! starting with `-`), or, for a record the HTTP layer wrote, by the
//! request that wrote it: `NAMESPACE --http-method M --http-route R
//! --http-key K [--http-caller C]` builds the id with
//! `idempotency_http::record_id`, the function the layer uses.

use idempotency::{escape_namespace, RecordKey, SharedRepository};
use idempotency_http::http::Method;

use crate::exit::Failure;

/// A record's key, in one of the forms above.
#[derive(Debug, Clone, Default, clap::Args)]
pub(crate) struct KeyArgs {
    /// The namespace (the manager's key prefix and scope, e.g.
    /// `idempotency:payments`), as `list` shows it in JSON's `namespace`.
    namespace: Option<String>,
    /// The id within the namespace, as stored (`list`'s JSON `id`). An id
    /// starting with `-` (an HTTP record's `-|4:POST|…`): give it with
    /// `--id=ID` instead.
    id: Option<String>,
    /// The id, as a flag: accepts an id starting with `-` (`--id=-|4:POST|7:/orders|k1`).
    #[arg(long = "id", value_name = "ID", allow_hyphen_values = true)]
    id_flag: Option<String>,
    /// The key exactly as this tool prints it (`list`'s `key` column or JSON
    /// `key`): `NAMESPACE:ID`, the namespace's `%`, `:`, `{`, `}` and control
    /// characters percent-escaped (`idempotency%3Apayments:evt-42`), the id
    /// verbatim. Quote it for the shell.
    #[arg(long, value_name = "KEY", allow_hyphen_values = true)]
    key: Option<String>,
    /// A record the HTTP layer (idempotency-http) wrote: the request's
    /// method. With NAMESPACE (the layer's manager scope, e.g. `idempotency:http`),
    /// `--http-route` and `--http-key`; the id is built as the layer builds it.
    #[arg(long, value_name = "METHOD", requires_all = ["http_route", "http_key"])]
    http_method: Option<String>,
    /// The HTTP record's route: the route template the layer was given (axum's
    /// matched path, e.g. `/orders/{id}`), or the request target (path and
    /// query) when the layer compares no fingerprint.
    #[arg(long, value_name = "ROUTE", requires = "http_method")]
    http_route: Option<String>,
    /// The HTTP record's `Idempotency-Key` header value (unquoted).
    #[arg(
        long,
        value_name = "KEY",
        requires = "http_method",
        allow_hyphen_values = true
    )]
    http_key: Option<String>,
    /// The HTTP record's caller identity, as the layer's caller function gave
    /// it (for `caller_from_header`, the SHA-256 hex digest of the header's
    /// value); none: the anonymous scope.
    #[arg(
        long,
        value_name = "CALLER",
        requires = "http_method",
        allow_hyphen_values = true
    )]
    http_caller: Option<String>,
}

/// The forms, for messages.
const FORMS: &str = "give NAMESPACE ID, NAMESPACE --id ID, --key KEY (as `list` prints it), \
                     or NAMESPACE --http-method M --http-route R --http-key K";

impl KeyArgs {
    /// Whether any part of a key was given.
    pub(crate) fn is_given(&self) -> bool {
        [
            &self.namespace,
            &self.id,
            &self.id_flag,
            &self.key,
            &self.http_method,
            &self.http_route,
            &self.http_key,
            &self.http_caller,
        ]
        .iter()
        .any(|part| part.is_some())
    }

    /// The key these arguments name, for a store indexing ids of at most
    /// `max_id_bytes` (longer ones digested, as the manager does).
    ///
    /// # Errors
    /// A usage failure for a missing, conflicting or malformed form.
    pub(crate) fn record_key(&self, max_id_bytes: usize) -> Result<RecordKey, Failure> {
        let id = self.id.as_ref().or(self.id_flag.as_ref());
        let http = self.http_method.is_some();
        let forms = [self.key.is_some(), id.is_some(), http]
            .iter()
            .filter(|given| **given)
            .count();
        if forms != 1
            || (self.id.is_some() && self.id_flag.is_some())
            || (self.key.is_some() && self.namespace.is_some())
        {
            return Err(Failure::usage(format!("name one record: {FORMS}")));
        }
        if let Some(encoded) = &self.key {
            return Ok(RecordKey::decode(encoded, max_id_bytes)?);
        }
        let namespace = self
            .namespace
            .as_deref()
            .ok_or_else(|| Failure::usage(format!("the NAMESPACE is missing: {FORMS}")))?;
        match id {
            Some(id) => Ok(RecordKey::from_stored(namespace, id, max_id_bytes)?),
            None => {
                let id = self.http_id()?;
                Ok(RecordKey::new(namespace, id, max_id_bytes)?)
            }
        }
    }

    /// The id the HTTP layer gives the request these flags describe.
    fn http_id(&self) -> Result<String, Failure> {
        let (Some(method), Some(route), Some(key)) =
            (&self.http_method, &self.http_route, &self.http_key)
        else {
            return Err(Failure::usage(
                "--http-method needs --http-route and --http-key",
            ));
        };
        let method = Method::from_bytes(method.to_ascii_uppercase().as_bytes())
            .map_err(|_| Failure::usage(format!("{method:?} is not an HTTP method")))?;
        Ok(idempotency_http::record_id(
            self.http_caller.as_deref(),
            &method,
            route,
            key,
        ))
    }
}

/// The key as the tool prints it (see the module's docs).
pub(crate) fn shown(key: &RecordKey) -> String {
    key.encode()
}

/// [`shown`] for a namespace and a stored id (a listing's record).
pub(crate) fn shown_parts(namespace: &str, id: &str) -> String {
    format!("{}:{id}", escape_namespace(namespace))
}

/// The store's longest indexed id.
pub(crate) fn max_id_bytes(store: &SharedRepository) -> usize {
    store.capabilities().max_id_bytes
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn args(f: impl FnOnce(&mut KeyArgs)) -> KeyArgs {
        let mut a = KeyArgs::default();
        f(&mut a);
        a
    }

    #[test]
    fn what_is_printed_is_read_back() {
        for (namespace, id) in [
            ("idempotency:payments", "order 42"),
            ("100%:{x}", "a%41b:c|d"),
            ("ns é", "-|4:POST|7:/orders|k 1"),
            ("ns", &"z".repeat(400)),
        ] {
            let key = RecordKey::new(namespace, id, 256).unwrap();
            let printed = shown(&key);
            assert_eq!(printed, shown_parts(key.namespace(), key.id()));
            let back = args(|a| a.key = Some(printed.clone()))
                .record_key(256)
                .unwrap();
            assert_eq!(back, key, "{printed}");
            let by_parts = args(|a| {
                a.namespace = Some(key.namespace().to_owned());
                a.id_flag = Some(key.id().to_owned());
            })
            .record_key(256)
            .unwrap();
            assert_eq!(by_parts, key);
        }
    }

    #[test]
    fn http_flags_build_the_layers_id() {
        let key = args(|a| {
            a.namespace = Some("idempotency:http".into());
            a.http_method = Some("post".into());
            a.http_route = Some("/orders".into());
            a.http_key = Some("k-1".into());
        })
        .record_key(256)
        .unwrap();
        assert_eq!(key.id(), "-|4:POST|7:/orders|k-1");
    }

    #[test]
    fn one_form_exactly() {
        let none = KeyArgs::default().record_key(256).unwrap_err();
        assert_eq!(none.code, crate::exit::USAGE);
        let two = args(|a| {
            a.namespace = Some("ns".into());
            a.id = Some("a".into());
            a.key = Some("ns:a".into());
        })
        .record_key(256)
        .unwrap_err();
        assert_eq!(two.code, crate::exit::USAGE);
        let malformed = args(|a| a.key = Some("no separator".into()))
            .record_key(256)
            .unwrap_err();
        assert_eq!(malformed.code, crate::exit::USAGE);
    }
}
