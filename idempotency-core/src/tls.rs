//! TLS failures that retrying cannot fix, for stores reached through rustls
//! (found with the feature `rustls`). The built-in Redis, PostgreSQL and
//! MySQL backends answer them as [`Error::Config`](crate::Error::Config), not as outages: a
//! certificate the client does not trust fails every attempt the same way.

use std::error::Error as StdError;

/// What is wrong, when `err` or an error in its source chain is a rustls
/// failure that retrying cannot fix: a certificate the client does not trust
/// (unknown issuer, another name, expired), a server that presented none, no
/// protocol version or cipher suite in common, or the server's alert that it
/// refused the client's certificate or the protocol. `None` for anything
/// else, a connection cut mid-handshake among them (an outage).
///
/// rustls reports handshake failures through the I/O layer, so the search
/// looks inside each [`std::io::Error`] of the chain, and inside
/// `Arc<dyn Error + Send + Sync>` wrappers (as the `redis` crate keeps I/O
/// errors).
///
/// Without the feature `rustls`, always `None`.
///
/// ```
/// use idempotency_core::tls::misconfiguration;
/// use std::io::{Error, ErrorKind};
///
/// let cut = Error::from(ErrorKind::ConnectionReset);
/// assert_eq!(misconfiguration(&cut), None);
///
/// # #[cfg(feature = "rustls")] {
/// let untrusted = Error::new(
///     ErrorKind::InvalidData,
///     rustls::Error::InvalidCertificate(rustls::CertificateError::UnknownIssuer),
/// );
/// assert!(misconfiguration(&untrusted).unwrap().contains("UnknownIssuer"));
/// # }
/// ```
pub fn misconfiguration(err: &(dyn StdError + 'static)) -> Option<String> {
    #[cfg(feature = "rustls")]
    {
        let mut next = Some(err);
        while let Some(e) = next {
            if let Some(tls) = as_rustls(e) {
                return permanent(tls).then(|| tls.to_string());
            }
            next = e.source();
        }
    }
    #[cfg(not(feature = "rustls"))]
    let _ = err;
    None
}

/// What is wrong, for a client library's own TLS error `tls` (such as
/// sqlx's `Error::Tls`: a server without TLS when TLS is required, a
/// certificate that cannot be parsed, a client built without TLS): always a
/// misconfiguration, unless it carries an I/O error, as a connection cut
/// mid-handshake does in some TLS libraries (native-tls), which is an
/// outage, or a rustls failure [`misconfiguration`] judges.
///
/// ```
/// use idempotency_core::tls::library_error;
/// let without: Box<dyn std::error::Error + Send + Sync> = "server does not support TLS".into();
/// assert_eq!(library_error(&*without).as_deref(), Some("server does not support TLS"));
/// let reset = std::io::Error::from(std::io::ErrorKind::ConnectionReset);
/// assert_eq!(library_error(&reset), None);
/// ```
pub fn library_error(tls: &(dyn StdError + 'static)) -> Option<String> {
    let carries_io =
        std::iter::successors(Some(tls), |&e| e.source()).any(|e| e.is::<std::io::Error>());
    if carries_io {
        misconfiguration(tls)
    } else {
        Some(tls.to_string())
    }
}

/// Whether retrying cannot cure `tls`: the certificates or the protocols
/// do not match, on our side or (an alert) on the server's.
#[cfg(feature = "rustls")]
fn permanent(tls: &rustls::Error) -> bool {
    use rustls::AlertDescription as A;
    match tls {
        rustls::Error::InvalidCertificate(_)
        | rustls::Error::NoCertificatesPresented
        | rustls::Error::PeerIncompatible(_) => true,
        rustls::Error::AlertReceived(alert) => matches!(
            alert,
            A::BadCertificate
                | A::UnsupportedCertificate
                | A::CertificateRevoked
                | A::CertificateExpired
                | A::CertificateUnknown
                | A::UnknownCA
                | A::CertificateRequired
                | A::AccessDenied
                | A::ProtocolVersion
                | A::InsufficientSecurity
                | A::HandshakeFailure
        ),
        _ => false,
    }
}

/// `e` as a rustls error: itself, the error an I/O error carries, or either
/// behind a shared `Arc`.
#[cfg(feature = "rustls")]
fn as_rustls<'a>(e: &'a (dyn StdError + 'static)) -> Option<&'a rustls::Error> {
    type Shared = std::sync::Arc<dyn StdError + Send + Sync>;
    let e: &(dyn StdError + 'static) = match e.downcast_ref::<Shared>() {
        Some(shared) => &**shared,
        None => e,
    };
    e.downcast_ref::<rustls::Error>().or_else(|| {
        e.downcast_ref::<std::io::Error>()
            .and_then(|io| io.get_ref())
            .and_then(|inner| inner.downcast_ref::<rustls::Error>())
    })
}

#[cfg(all(test, feature = "rustls"))]
mod tests {
    use super::*;
    use std::io::{Error, ErrorKind};
    use std::sync::Arc;

    fn invalid_data(tls: rustls::Error) -> Error {
        Error::new(ErrorKind::InvalidData, tls)
    }

    /// An error whose source is `inner`, as a client library wraps one.
    #[derive(Debug)]
    struct Wrapped(Box<dyn StdError + Send + Sync>);

    impl std::fmt::Display for Wrapped {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("connecting failed")
        }
    }

    impl StdError for Wrapped {
        fn source(&self) -> Option<&(dyn StdError + 'static)> {
            Some(&*self.0)
        }
    }

    #[test]
    fn certificates_and_incompatible_peers_are_misconfigurations() {
        use rustls::{CertificateError, PeerIncompatible};
        for tls in [
            rustls::Error::InvalidCertificate(CertificateError::UnknownIssuer),
            rustls::Error::InvalidCertificate(CertificateError::Expired),
            rustls::Error::NoCertificatesPresented,
            rustls::Error::PeerIncompatible(PeerIncompatible::NoCipherSuitesInCommon),
            // The server refused our client certificate.
            rustls::Error::AlertReceived(rustls::AlertDescription::CertificateRequired),
            rustls::Error::AlertReceived(rustls::AlertDescription::UnknownCA),
        ] {
            let shown = tls.to_string();
            // Directly, inside an I/O error, behind a wrapper, behind an Arc.
            assert_eq!(misconfiguration(&tls), Some(shown.clone()));
            let io = invalid_data(tls.clone());
            assert_eq!(misconfiguration(&io), Some(shown.clone()));
            let wrapped = Wrapped(Box::new(invalid_data(tls.clone())));
            assert_eq!(misconfiguration(&wrapped), Some(shown.clone()));
            let shared: Arc<dyn StdError + Send + Sync> = Arc::new(invalid_data(tls));
            assert_eq!(misconfiguration(&Wrapped(Box::new(shared))), Some(shown));
        }
    }

    #[test]
    fn cut_connections_and_other_failures_are_not() {
        assert_eq!(
            misconfiguration(&Error::from(ErrorKind::ConnectionReset)),
            None
        );
        assert_eq!(
            misconfiguration(&Error::from(ErrorKind::UnexpectedEof)),
            None
        );
        let alert = invalid_data(rustls::Error::AlertReceived(
            rustls::AlertDescription::InternalError,
        ));
        assert_eq!(misconfiguration(&alert), None);
        assert_eq!(misconfiguration(&Wrapped("plain".into())), None);
    }
}
