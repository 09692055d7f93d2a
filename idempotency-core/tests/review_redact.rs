//! Review: `redact_url` splits off the query at the first `?`, before it
//! finds the user information, so a password containing `?` is printed.

use idempotency_core::redact_url;

#[test]
fn a_password_with_a_question_mark_is_not_printed() {
    let shown = redact_url("postgres://app:se?cret@db/shop");
    assert!(
        !shown.contains("cret") && !shown.contains("se?"),
        "the password leaks: {shown}"
    );
}
