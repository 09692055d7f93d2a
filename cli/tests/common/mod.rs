//! Running the tool as a process, for the tests of this directory.

#![allow(dead_code, unreachable_pub, clippy::unwrap_used, clippy::expect_used)]

use std::process::Command;

use idempotency_conformance::containers;
use serde_json::Value;

/// What one run of the tool gave.
#[derive(Debug)]
pub struct Run {
    /// Its exit status.
    pub code: i32,
    /// Standard output, parsed as JSON (`Value::Null` when it is not).
    pub json: Value,
    /// Standard output.
    pub stdout: String,
    /// Standard error.
    pub stderr: String,
}

/// The tool with `args` after `--url url`, as a script runs it (`--format json`
/// when `json`); standard error is a pipe, never a terminal.
pub fn run(url: &str, json: bool, args: &[&str]) -> Run {
    let mut command = Command::new(env!("CARGO_BIN_EXE_idempotency"));
    if json {
        command.args(["--format", "json"]);
    }
    let out = command
        .args(["--url", url])
        .args(args)
        .env_remove("IDEMPOTENCY_STORE_URL")
        .env_remove("IDEMPOTENCY_CLOCK_SKEW")
        .output()
        .expect("the tool runs");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    Run {
        code: out.status.code().unwrap_or(-1),
        json: serde_json::from_str(stdout.trim()).unwrap_or(Value::Null),
        stdout,
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

/// [`run`] with `--format json`.
pub fn json(url: &str, args: &[&str]) -> Run {
    run(url, true, args)
}

/// A path for a SQLite file of its own, not created.
pub fn sqlite_path() -> std::path::PathBuf {
    let dir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("cli");
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(format!("{}.db", containers::unique_namespace("cli")))
}

/// A migrated SQLite database of its own: its URL.
pub fn sqlite_url() -> String {
    let url = format!("sqlite://{}", sqlite_path().display());
    let migrated = json(&url, &["migrate"]);
    assert_eq!(migrated.code, 0, "{}", migrated.stderr);
    url
}

/// The verdict of the check named `name` in a doctor report.
pub fn check<'a>(report: &'a Value, name: &str) -> &'a Value {
    report["checks"]
        .as_array()
        .and_then(|checks| checks.iter().find(|c| c["name"] == name))
        .unwrap_or_else(|| panic!("no check {name:?} in {report}"))
}
