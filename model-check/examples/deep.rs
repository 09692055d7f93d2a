//! A deeper run of the model than the test suite's bounded one.
//!
//! ```text
//! cargo run -p idempotency-model --release --example deep -- --consumers 3
//! ```
//!
//! Options (defaults in brackets): `--consumers N` [3] (clocks 0, 1, 0, 1, …
//! ticks ahead: within the two-tick allowance), `--offsets a,b,…` (each
//! consumer's clock offset, instead), `--deliveries N` [2], `--time N` [4],
//! `--faults N` [0], `--crashes N` [1], `--drops N` [0], `--extension`,
//! `--handler-failures`, `--store-failures` (failure policy
//! store_and_retry), `--release-on-cancel`, `--answer-cache TICKS`,
//! `--broken skew|owner|no-time-box`, `--threads N` [2].

use std::process::ExitCode;

use idempotency_core::{CancelPolicy, FailurePolicy};
use idempotency_model::{check, Broken, ModelConfig};

fn main() -> ExitCode {
    match run() {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(2)
        }
    }
}

fn run() -> Result<bool, String> {
    let mut config = ModelConfig {
        clock_offsets: vec![0, 1, 0],
        max_time: 4,
        faults: 0,
        crashes: 1,
        ..ModelConfig::default()
    };
    let mut threads = 2;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let mut value = || args.next().ok_or(format!("{arg} needs a value"));
        let number = |v: String| v.parse::<u8>().map_err(|e| format!("{v}: {e}"));
        match arg.as_str() {
            "--consumers" => {
                let n = number(value()?)?;
                config.clock_offsets = (0..n).map(|i| i % 2).collect();
            }
            "--offsets" => {
                config.clock_offsets = value()?
                    .split(',')
                    .map(|v| number(v.to_owned()))
                    .collect::<Result<_, _>>()?;
            }
            "--deliveries" => config.deliveries = number(value()?)?,
            "--time" => config.max_time = number(value()?)?,
            "--faults" => config.faults = number(value()?)?,
            "--crashes" => config.crashes = number(value()?)?,
            "--drops" => config.drops = number(value()?)?,
            "--extension" => config.extension = true,
            "--handler-failures" => config.handler_failures = true,
            "--store-failures" => config.failure_policy = FailurePolicy::StoreAndRetry,
            "--release-on-cancel" => config.on_cancel = CancelPolicy::Release,
            "--answer-cache" => config.answer_cache = Some(number(value()?)?),
            "--threads" => threads = usize::from(number(value()?)?),
            "--broken" => {
                config.broken = Some(match value()?.as_str() {
                    "skew" => Broken::TakeoverWithoutSkew,
                    "owner" => Broken::OwnerUncheckedComplete,
                    "no-time-box" => Broken::NoTimeBox,
                    other => return Err(format!("--broken skew|owner|no-time-box, not {other}")),
                })
            }
            other => return Err(format!("unknown option {other}")),
        }
    }
    println!("{config:?}");
    let report = check(config, threads).map_err(|e| e.to_string())?;
    print!("{report}");
    Ok(report.failures().is_empty())
}
