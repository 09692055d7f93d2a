//! Command-line options.

use std::path::PathBuf;

use crate::driver::Plan;
use crate::{BoxError, Scenario};

/// The usage text.
pub const USAGE: &str = "\
idempotency-bench: every store of idempotency-rs against its raw client, interleaved

USAGE: cargo run --release -p idempotency-bench -- [OPTIONS]

OPTIONS:
  --backends LIST         memory,sqlite,redis,redis-cluster,postgres,mysql,dynamodb (default:
                          all compiled in; redis-cluster needs the feature of that name)
  --ops N                 measured operations per variant, scenario and concurrency
                          (default 20000; split over the rounds; at least, see
                          --min-round-ms)
  --memory-ops N          the same for the in-memory store (default 400000)
  --dynamodb-ops N        the same for DynamoDB (default 2000; emulators are slow)
  --concurrency LIST      tasks issuing operations at once (default 1,64)
  --scenarios LIST        fresh,duplicate,cached,batch-fresh,batch-duplicate (default:
                          all; cached: duplicates answered from the local answer cache;
                          batch-*: execute_batch of 100 messages against the same 100
                          through execute, one at a time)
  --rounds N              measured rounds per variant, alternating A B B A … (default 10)
  --min-round-ms MS       stretch rounds to last at least this long at the warm-up's rate
                          (default 250; 0 keeps exactly ops/rounds per round)
  --warmup N              unmeasured operations per variant first (default ops/10, ≤ 2000)
  --count-ops N           operations of the untimed round-trip counting pass (default 200)
  --redis-url URL         Redis server (default $IDEMPOTENCY_BENCH_REDIS_URL, else the
                          test harness: $IDEMPOTENCY_TEST_REDIS_URL or a container)
  --redis-cluster-url URL redis+cluster://h:p,h:p,… (default
                          $IDEMPOTENCY_BENCH_REDIS_CLUSTER_URL, else the harness's cluster)
  --postgres-url URL      PostgreSQL server (default $IDEMPOTENCY_BENCH_POSTGRES_URL, else
                          the harness)
  --postgres-pool N       connections in the pool shared by library and raw (default 32)
  --mysql-url URL         MySQL or MariaDB server, a database in the path (default
                          $IDEMPOTENCY_BENCH_MYSQL_URL, else the harness's MariaDB)
  --mysql-pool N          connections in the pool shared by library and raw (default 32)
  --dynamodb-endpoint URL DynamoDB-compatible endpoint (default
                          $IDEMPOTENCY_BENCH_DYNAMODB_ENDPOINT, else the harness)
  --dynamodb-region R     region for the endpoint (default us-east-1)
  --sqlite-synchronous S  SQLite's synchronous for the SQLite file: full (default, the
                          library's default) or normal
  --brokers LIST          kafka,sqs,rabbitmq: broker benchmarks (needs the features of those names):
                          each broker's consumer of idempotency-consumers against the same
                          consumer loop without it, fresh and duplicate messages; alone,
                          it runs no store benchmark unless --backends is given too
  --broker-stores LIST    the consumers' stores: memory,redis (default: both; redis needs
                          its feature; Redis from --redis-url or the harness)
  --kafka-messages N      measured messages per variant and scenario for Kafka (default
                          20000; rounds are whole batches of 100)
  --rabbitmq-messages N   the same for RabbitMQ (default 10000)
  --sqs-messages N        the same for SQS (default 1000; rounds are whole receives of 10)
  --kafka-concurrency N   keys of a Kafka batch the consumer reserves and runs at once
                          (default 16, the consumer's default; each group of that many is
                          one reservation round trip, one after another)
  --sqs-pollers N         SQS poll loops per variant (default 10: 10 receives of 10 = a
                          batch of 100)
  --kafka-brokers LIST    Kafka bootstrap servers (default $IDEMPOTENCY_BENCH_KAFKA_BROKERS,
                          else librdkafka's in-process mock cluster)
  --rabbitmq-url URL      amqp://… (default $IDEMPOTENCY_BENCH_RABBITMQ_URL, else the
                          harness's broker: $IDEMPOTENCY_TEST_RABBITMQ_URL or a container)
  --sqs-endpoint URL      SQS endpoint (default $IDEMPOTENCY_BENCH_SQS_ENDPOINT, else the
                          harness's server: $IDEMPOTENCY_TEST_SQS_ENDPOINT or a container)
  --out DIR               where results.{json,md} and chart.svg go (default
                          $CARGO_TARGET_DIR/bench, else target/bench)
  --quick                 a short run (2000 ops, 2 rounds): checks the setup, not speed
  -h, --help              this text
";

/// Parsed options.
#[derive(Debug, Clone)]
pub struct Args {
    /// Backends to run, in order.
    pub backends: Vec<String>,
    /// The plan for network stores.
    pub plan: Plan,
    /// Measured operations for the memory store.
    pub memory_ops: usize,
    /// Measured operations for DynamoDB.
    pub dynamodb_ops: usize,
    /// Redis URL, if given.
    pub redis_url: Option<String>,
    /// Redis Cluster URL (`redis+cluster://…`), if given.
    pub redis_cluster_url: Option<String>,
    /// PostgreSQL URL, if given.
    pub postgres_url: Option<String>,
    /// Pool size for PostgreSQL.
    pub postgres_pool: u32,
    /// MySQL URL, if given.
    pub mysql_url: Option<String>,
    /// Pool size for MySQL.
    pub mysql_pool: u32,
    /// DynamoDB endpoint, if given.
    pub dynamodb_endpoint: Option<String>,
    /// DynamoDB region.
    pub dynamodb_region: String,
    /// SQLite's `synchronous` for the SQLite workload.
    pub sqlite_synchronous: String,
    /// Brokers to benchmark (`kafka`, `sqs`).
    pub brokers: Vec<String>,
    /// Stores the broker consumers run over.
    pub broker_stores: Vec<String>,
    /// Measured messages per variant and scenario, Kafka.
    pub kafka_messages: usize,
    /// Measured messages per variant and scenario, RabbitMQ.
    pub rabbitmq_messages: usize,
    /// RabbitMQ URL, if given.
    pub rabbitmq_url: Option<String>,
    /// Measured messages per variant and scenario, SQS.
    pub sqs_messages: usize,
    /// SQS poll loops per variant.
    pub sqs_pollers: usize,
    /// The Kafka consumer's concurrency.
    pub kafka_concurrency: usize,
    /// Kafka bootstrap servers, if given.
    pub kafka_brokers: Option<String>,
    /// SQS endpoint, if given.
    pub sqs_endpoint: Option<String>,
    /// Output directory.
    pub out: PathBuf,
    /// `--help` was asked for.
    pub help: bool,
}

/// Backends compiled into this binary.
pub fn compiled_backends() -> Vec<String> {
    let mut all = vec!["memory"];
    if cfg!(feature = "sqlite") {
        all.push("sqlite");
    }
    if cfg!(feature = "redis") {
        all.push("redis");
    }
    if cfg!(feature = "redis-cluster") {
        all.push("redis-cluster");
    }
    if cfg!(feature = "postgres") {
        all.push("postgres");
    }
    if cfg!(feature = "mysql") {
        all.push("mysql");
    }
    if cfg!(feature = "dynamodb") {
        all.push("dynamodb");
    }
    all.into_iter().map(str::to_owned).collect()
}

fn default_out() -> PathBuf {
    match std::env::var_os("CARGO_TARGET_DIR") {
        Some(dir) => PathBuf::from(dir).join("bench"),
        None => PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("..")
            .join("target")
            .join("bench"),
    }
}

fn number<T: std::str::FromStr>(flag: &str, value: &str) -> Result<T, BoxError> {
    value
        .parse()
        .map_err(|_| format!("{flag}: {value:?} is not a valid number").into())
}

fn list(value: &str) -> Vec<String> {
    value
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(str::to_owned)
        .collect()
}

impl Args {
    /// Parses `args` (without the program name), with `env` for defaults.
    ///
    /// # Errors
    /// Unknown flags, missing values, bad numbers, unknown backends.
    pub fn parse(
        args: impl IntoIterator<Item = String>,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<Self, BoxError> {
        let mut a = Args {
            backends: compiled_backends(),
            plan: Plan {
                ops: 20_000,
                rounds: 10,
                warmup: 0,
                count_ops: 200,
                concurrencies: vec![1, 64],
                scenarios: Scenario::ALL.to_vec(),
                min_round: std::time::Duration::from_millis(250),
            },
            memory_ops: 400_000,
            dynamodb_ops: 2_000,
            redis_url: env("IDEMPOTENCY_BENCH_REDIS_URL"),
            redis_cluster_url: env("IDEMPOTENCY_BENCH_REDIS_CLUSTER_URL"),
            postgres_url: env("IDEMPOTENCY_BENCH_POSTGRES_URL"),
            postgres_pool: 32,
            mysql_url: env("IDEMPOTENCY_BENCH_MYSQL_URL"),
            mysql_pool: 32,
            dynamodb_endpoint: env("IDEMPOTENCY_BENCH_DYNAMODB_ENDPOINT"),
            dynamodb_region: "us-east-1".to_owned(),
            sqlite_synchronous: "full".to_owned(),
            brokers: Vec::new(),
            broker_stores: crate::brokers::compiled_stores(),
            kafka_messages: 20_000,
            sqs_messages: 1_000,
            rabbitmq_messages: 10_000,
            rabbitmq_url: env("IDEMPOTENCY_BENCH_RABBITMQ_URL"),
            sqs_pollers: crate::brokers::SQS_POLLERS,
            kafka_concurrency: 16,
            kafka_brokers: env("IDEMPOTENCY_BENCH_KAFKA_BROKERS"),
            sqs_endpoint: env("IDEMPOTENCY_BENCH_SQS_ENDPOINT"),
            out: default_out(),
            help: false,
        };
        let mut warmup = None;
        let mut backends_given = false;
        let mut it = args.into_iter();
        while let Some(flag) = it.next() {
            if flag == "-h" || flag == "--help" {
                a.help = true;
                continue;
            }
            if flag == "--quick" {
                a.plan.ops = 2_000;
                a.plan.rounds = 2;
                a.plan.min_round = std::time::Duration::ZERO;
                a.plan.count_ops = 50;
                a.memory_ops = 20_000;
                a.dynamodb_ops = 200;
                a.kafka_messages = 2_000;
                a.sqs_messages = 200;
                a.rabbitmq_messages = 2_000;
                continue;
            }
            let (flag, inline) = match flag.split_once('=') {
                Some((f, v)) => (f.to_owned(), Some(v.to_owned())),
                None => (flag, None),
            };
            let mut value = || {
                inline
                    .clone()
                    .or_else(|| it.next())
                    .ok_or_else(|| BoxError::from(format!("{flag} needs a value")))
            };
            match flag.as_str() {
                "--backends" => {
                    a.backends = list(&value()?);
                    backends_given = true;
                }
                "--ops" => a.plan.ops = number(&flag, &value()?)?,
                "--memory-ops" => a.memory_ops = number(&flag, &value()?)?,
                "--dynamodb-ops" => a.dynamodb_ops = number(&flag, &value()?)?,
                "--rounds" => a.plan.rounds = number(&flag, &value()?)?,
                "--min-round-ms" => {
                    a.plan.min_round = std::time::Duration::from_millis(number(&flag, &value()?)?);
                }
                "--warmup" => warmup = Some(number(&flag, &value()?)?),
                "--count-ops" => a.plan.count_ops = number(&flag, &value()?)?,
                "--concurrency" => {
                    a.plan.concurrencies = list(&value()?)
                        .iter()
                        .map(|c| number::<usize>(&flag, c))
                        .collect::<Result<_, _>>()?;
                }
                "--scenarios" => {
                    a.plan.scenarios = list(&value()?)
                        .iter()
                        .map(|s| {
                            Scenario::parse(s).ok_or_else(|| {
                                BoxError::from(format!(
                                    "unknown scenario {s:?} (have: fresh, duplicate, cached, \
                                     batch-fresh, batch-duplicate)"
                                ))
                            })
                        })
                        .collect::<Result<_, _>>()?;
                }
                "--redis-url" => a.redis_url = Some(value()?),
                "--redis-cluster-url" => a.redis_cluster_url = Some(value()?),
                "--postgres-url" => a.postgres_url = Some(value()?),
                "--postgres-pool" => a.postgres_pool = number(&flag, &value()?)?,
                "--mysql-url" => a.mysql_url = Some(value()?),
                "--mysql-pool" => a.mysql_pool = number(&flag, &value()?)?,
                "--dynamodb-endpoint" => a.dynamodb_endpoint = Some(value()?),
                "--dynamodb-region" => a.dynamodb_region = value()?,
                "--sqlite-synchronous" => a.sqlite_synchronous = value()?,
                "--out" => a.out = PathBuf::from(value()?),
                other => {
                    if !a.broker_option(other, &mut value)? {
                        return Err(format!("unknown option {other}; see --help").into());
                    }
                }
            }
        }
        let compiled = compiled_backends();
        if let Some(unknown) = a.backends.iter().find(|b| !compiled.contains(b)) {
            return Err(format!(
                "backend {unknown:?} is not compiled into this binary (have: {})",
                compiled.join(", ")
            )
            .into());
        }
        a.check_brokers(backends_given)?;
        if a.plan.scenarios.is_empty() {
            return Err("--scenarios needs at least one of fresh, duplicate, cached, batch-fresh, batch-duplicate".into());
        }
        if a.plan.concurrencies.is_empty() || a.plan.concurrencies.contains(&0) {
            return Err("--concurrency needs positive numbers".into());
        }
        if a.plan.ops == 0 || a.plan.rounds == 0 || a.memory_ops == 0 || a.dynamodb_ops == 0 {
            return Err("operation counts and --rounds must be positive".into());
        }
        a.plan.warmup = warmup.unwrap_or((a.plan.ops / 10).min(2_000));
        Ok(a)
    }

    /// Takes `flag` if it is a broker option (`false`: not one).
    fn broker_option(
        &mut self,
        flag: &str,
        value: &mut dyn FnMut() -> Result<String, BoxError>,
    ) -> Result<bool, BoxError> {
        match flag {
            "--brokers" => self.brokers = list(&value()?),
            "--broker-stores" => self.broker_stores = list(&value()?),
            "--kafka-messages" => self.kafka_messages = number(flag, &value()?)?,
            "--sqs-messages" => self.sqs_messages = number(flag, &value()?)?,
            "--rabbitmq-messages" => self.rabbitmq_messages = number(flag, &value()?)?,
            "--rabbitmq-url" => self.rabbitmq_url = Some(value()?),
            "--sqs-pollers" => self.sqs_pollers = number(flag, &value()?)?,
            "--kafka-concurrency" => self.kafka_concurrency = number(flag, &value()?)?,
            "--kafka-brokers" => self.kafka_brokers = Some(value()?),
            "--sqs-endpoint" => self.sqs_endpoint = Some(value()?),
            _ => return Ok(false),
        }
        Ok(true)
    }

    /// Checks the broker options; `--brokers` without `--backends` runs
    /// the brokers alone.
    fn check_brokers(&mut self, backends_given: bool) -> Result<(), BoxError> {
        if self.brokers.is_empty() {
            return Ok(());
        }
        if !backends_given {
            self.backends.clear();
        }
        for (kind, given, compiled) in [
            ("broker", &self.brokers, crate::brokers::compiled_brokers()),
            (
                "store",
                &self.broker_stores,
                crate::brokers::compiled_stores(),
            ),
        ] {
            if let Some(unknown) = given.iter().find(|b| !compiled.contains(b)) {
                return Err(format!(
                    "{kind} {unknown:?} is not compiled into this binary (have: {})",
                    compiled.join(", ")
                )
                .into());
            }
        }
        if self.broker_stores.is_empty() {
            return Err("--broker-stores needs at least one store".into());
        }
        if self.kafka_messages == 0 || self.sqs_messages == 0 || self.sqs_pollers == 0 {
            return Err(
                "--kafka-messages, --sqs-messages and --sqs-pollers must be positive".into(),
            );
        }
        if self.broker_plan("kafka").scenarios.is_empty() {
            return Err("the broker benchmarks run the fresh and duplicate scenarios: --scenarios has neither".into());
        }
        Ok(())
    }

    /// The plan for `broker`: its message count, the rounds and the fresh
    /// and duplicate scenarios of `--scenarios`.
    pub fn broker_plan(&self, broker: &str) -> crate::brokers::BrokerPlan {
        let messages = match broker {
            "sqs" => self.sqs_messages,
            "rabbitmq" => self.rabbitmq_messages,
            _ => self.kafka_messages,
        };
        crate::brokers::BrokerPlan {
            messages,
            poll: if broker == "sqs" {
                10
            } else {
                crate::brokers::BATCH
            },
            rounds: self.plan.rounds,
            warmup: (messages / 10).clamp(100, 1_000),
            scenarios: self
                .plan
                .scenarios
                .iter()
                .copied()
                .filter(|s| matches!(s, Scenario::Fresh | Scenario::Duplicate))
                .collect(),
        }
    }

    /// The plan for `backend`: its operation count, the rest shared.
    pub fn plan_for(&self, backend: &str) -> Plan {
        let mut plan = self.plan.clone();
        let ops = match backend {
            "memory" => self.memory_ops,
            "dynamodb" => self.dynamodb_ops,
            _ => return plan,
        };
        plan.ops = ops;
        plan.warmup = (ops / 10).min(if backend == "memory" { 20_000 } else { 200 });
        plan
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<Args, BoxError> {
        Args::parse(args.iter().map(|s| (*s).to_owned()), |_| None)
    }

    #[test]
    fn defaults_follow_the_issue() {
        let a = parse(&[]).unwrap();
        assert_eq!(a.plan.concurrencies, vec![1, 64]);
        assert_eq!(a.plan.ops, 20_000);
        assert_eq!(a.plan.warmup, 2_000);
        assert_eq!(a.plan.rounds, 10);
        assert_eq!(a.plan.min_round.as_millis(), 250);
        let q = parse(&["--quick", "--min-round-ms", "100"]).unwrap();
        assert_eq!(q.plan.min_round.as_millis(), 100);
        assert_eq!(a.backends[0], "memory");
        assert!(a.out.ends_with("bench"));
    }

    #[test]
    fn flags_take_separate_or_inline_values() {
        let a = parse(&[
            "--backends",
            "memory",
            "--ops=100",
            "--concurrency",
            "1,16,64",
        ])
        .unwrap();
        assert_eq!(a.backends, vec!["memory"]);
        assert_eq!(a.plan.ops, 100);
        assert_eq!(a.plan.warmup, 10);
        assert_eq!(a.plan.concurrencies, vec![1, 16, 64]);
        assert_eq!(a.plan.scenarios, Scenario::ALL.to_vec());
        let d = parse(&["--scenarios", "duplicate"]).unwrap();
        assert_eq!(d.plan.scenarios, vec![Scenario::Duplicate]);
        assert_eq!(a.plan_for("memory").ops, 400_000);
    }

    #[test]
    fn bad_input_is_an_error_not_a_panic() {
        for bad in [
            &["--ops", "many"][..],
            &["--ops"],
            &["--concurrency", "0"],
            &["--backends", "cassandra"],
            &["--scenarios", "stale"],
            &["--scenarios", ""],
            &["--frobnicate"],
        ] {
            assert!(parse(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn brokers_alone_run_no_store_benchmark() {
        let a = parse(&[]).unwrap();
        assert!(a.brokers.is_empty() && !a.backends.is_empty());
        let compiled = crate::brokers::compiled_brokers();
        if let Some(broker) = compiled.first() {
            let b = parse(&["--brokers", broker]).unwrap();
            assert!(b.backends.is_empty());
            assert_eq!(
                b.broker_plan(broker).scenarios,
                vec![Scenario::Fresh, Scenario::Duplicate]
            );
            assert_eq!(b.broker_plan("kafka").per_round(), 2_000);
            let both = parse(&["--brokers", broker, "--backends", "memory"]).unwrap();
            assert_eq!(both.backends, vec!["memory"]);
            assert!(parse(&["--brokers", broker, "--scenarios", "cached"]).is_err());
            assert!(parse(&["--brokers", broker, "--broker-stores", "etcd"]).is_err());
        }
        assert!(parse(&["--brokers", "nats"]).is_err());
    }

    #[test]
    fn urls_come_from_the_environment() {
        let a = Args::parse(Vec::new(), |k| {
            (k == "IDEMPOTENCY_BENCH_REDIS_URL").then(|| "redis://10.0.0.1".to_owned())
        })
        .unwrap();
        assert_eq!(a.redis_url.as_deref(), Some("redis://10.0.0.1"));
    }
}
