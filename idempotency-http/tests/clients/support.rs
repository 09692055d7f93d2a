//! What the client tests stand on: a real axum server on `127.0.0.1` behind
//! the layer, a proxy that cuts a connection after the handler ran, and the
//! baked `python-clients` image run with the `docker` CLI.

#![allow(unreachable_pub)]

use std::collections::HashMap;
use std::net::SocketAddr;
use std::process::Stdio;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::{Form, Request, State};
use axum::http::{HeaderName, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use idempotency_conformance::containers::unique_namespace;
use idempotency_core::{Config, IdempotencyManager, MemoryRepository};
use idempotency_http::IdempotencyLayer;
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Notify;

/// The layer's cache cap in these tests: `/exports` answers more.
pub const CAP: usize = 4 * 1024;
/// The size of an `/exports` answer.
pub const EXPORT_LEN: usize = 64 * 1024;
/// How long a handler is held at most, and the bound of every wait (never
/// reached when the code is right).
const PATIENCE: Duration = Duration::from_secs(30);
/// The bound of one client script's run, container start included.
const SCRIPT_TIMEOUT: Duration = Duration::from_secs(120);
/// The image variable, as `scripts/bake-images.sh --print-env` prints it.
const IMAGE_VARIABLE: &str = "IDEMPOTENCY_TEST_PYTHON_CLIENTS_IMAGE";
const BAKED_IMAGE: &str = "idempotency-test/python-clients:bookworm";

/// One request as the server saw it, outside the layer.
#[derive(Clone, Debug)]
pub struct Seen {
    pub path: String,
    pub key: Option<String>,
    pub status: u16,
    pub retry_after: Option<String>,
}

/// Counters the handlers and the outer observer share.
#[derive(Default)]
pub struct Shared {
    runs: Mutex<HashMap<&'static str, usize>>,
    seen: Mutex<Vec<Seen>>,
    conflicts: AtomicUsize,
    notify: Notify,
    /// `/orders` is held until this many `409`s went out.
    pub hold_until_conflicts: AtomicUsize,
}

impl Shared {
    fn bump(&self, route: &'static str) -> usize {
        let mut runs = self.runs.lock().unwrap();
        let n = runs.entry(route).or_default();
        *n += 1;
        *n
    }

    /// How often the handler of `route` ran.
    pub fn runs(&self, route: &str) -> usize {
        self.runs.lock().unwrap().get(route).copied().unwrap_or(0)
    }

    /// Every request that reached the server, in order, with its answer.
    pub fn seen(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }

    async fn wait_conflicts(&self, n: usize) -> bool {
        tokio::time::timeout(PATIENCE, async {
            loop {
                let notified = self.notify.notified();
                if self.conflicts.load(Ordering::SeqCst) >= n {
                    return;
                }
                notified.await;
            }
        })
        .await
        .is_ok()
    }
}

/// A running server: `/orders`, `/exports` and Stripe's `/v1/customers`
/// behind [`IdempotencyLayer`] over the in-memory store.
pub struct Server {
    pub addr: SocketAddr,
    pub shared: Arc<Shared>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Server {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Server {
    /// Starts on a random port; `replayed_header` names the replay header
    /// (the layer's default when `None`).
    pub async fn start(replayed_header: Option<HeaderName>) -> Server {
        let config = Config {
            key_prefix: unique_namespace("clients"),
            ..Config::default()
        };
        let manager = IdempotencyManager::new(Arc::new(MemoryRepository::new()), config).unwrap();
        // Stripe's SDK sends its key in `Idempotency-Key`, the layer's default
        // header, named here to make that visible.
        let mut layer = IdempotencyLayer::new(manager)
            .header(idempotency_http::IDEMPOTENCY_KEY)
            .max_cached_body(CAP);
        if let Some(name) = replayed_header {
            layer = layer.replayed_header(name);
        }
        let shared = Arc::new(Shared::default());
        let app = Router::new()
            .route("/orders", post(create_order))
            .route("/exports", post(export))
            .route("/v1/customers", post(create_customer))
            .layer(layer)
            .layer(middleware::from_fn_with_state(shared.clone(), observe))
            .with_state(shared.clone());
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let task = tokio::spawn(async move {
            axum::serve(listener, app).await.unwrap();
        });
        Server { addr, shared, task }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }
}

/// Records every request and its answer as they pass, outside the layer.
async fn observe(State(shared): State<Arc<Shared>>, request: Request, next: Next) -> Response {
    let path = request.uri().path().to_owned();
    let key = request
        .headers()
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let response = next.run(request).await;
    let retry_after = response
        .headers()
        .get("retry-after")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    shared.seen.lock().unwrap().push(Seen {
        path,
        key,
        status: response.status().as_u16(),
        retry_after,
    });
    if response.status() == StatusCode::CONFLICT {
        shared.conflicts.fetch_add(1, Ordering::SeqCst);
        shared.notify.notify_waiters();
    }
    response
}

/// Creates an order, held in flight until the duplicates were answered `409`
/// as often as the test asks (at most [`PATIENCE`]).
async fn create_order(State(shared): State<Arc<Shared>>, body: String) -> impl IntoResponse {
    let n = shared.bump("orders");
    let wanted = shared.hold_until_conflicts.load(Ordering::SeqCst);
    let held = shared.wait_conflicts(wanted).await;
    (
        StatusCode::CREATED,
        Json(json!({ "order": n, "request": body, "held_until_conflicts": held })),
    )
}

/// An answer larger than the cache cap: streamed to the first client, not kept.
async fn export(State(shared): State<Arc<Shared>>) -> impl IntoResponse {
    let n = shared.bump("exports");
    let mut text = format!("export {n}\n");
    text.push_str(&"x".repeat(EXPORT_LEN - text.len()));
    (StatusCode::OK, text)
}

/// Stripe's `POST /v1/customers`: a form-encoded request, a customer object.
async fn create_customer(
    State(shared): State<Arc<Shared>>,
    Form(form): Form<HashMap<String, String>>,
) -> impl IntoResponse {
    let n = shared.bump("customers");
    let field = |name: &str| form.get(name).cloned().map_or(Value::Null, Value::String);
    Json(json!({
        "id": format!("cus_idem{n:010}"),
        "object": "customer",
        "created": 1_700_000_000 + n,
        "email": field("email"),
        "name": field("name"),
        "livemode": false,
        "metadata": {},
    }))
}

/// A TCP proxy to `upstream` that cuts its first connection once the
/// server's answer begins (the handler ran), before a byte of it reaches the
/// client; later connections are relayed whole.
pub async fn cut_first_answer(upstream: SocketAddr) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        let mut first = true;
        while let Ok((client, _)) = listener.accept().await {
            let cut = std::mem::take(&mut first);
            tokio::spawn(relay(client, upstream, cut));
        }
    });
    addr
}

async fn relay(mut client: TcpStream, upstream: SocketAddr, cut: bool) {
    let Ok(mut server) = TcpStream::connect(upstream).await else {
        return;
    };
    if !cut {
        let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
        return;
    }
    let (mut client_read, mut client_write) = client.into_split();
    let (mut server_read, mut server_write) = server.into_split();
    let forward = tokio::spawn(async move {
        let _ = tokio::io::copy(&mut client_read, &mut server_write).await;
    });
    let mut first_byte = [0u8; 1];
    let _ = tokio::time::timeout(PATIENCE, server_read.read(&mut first_byte)).await;
    forward.abort();
    // Closed with nothing sent: the client sees the connection end before
    // any answer (Python: `RemoteDisconnected`).
    let _ = client_write.shutdown().await;
}

/// Runs `script` (a file of `tests/clients/`, given as text) with `args` in a
/// container of the python-clients image on the host network, and returns the
/// JSON object it printed last. Panics, with what to do, when Docker or the
/// image is missing: these tests never pass without running the clients.
pub async fn run_python(script: &str, args: &[String]) -> Value {
    let image = std::env::var(IMAGE_VARIABLE).unwrap_or_else(|_| BAKED_IMAGE.to_owned());
    ensure_image(&image).await;
    let name = unique_namespace("idempotency-http-clients");
    let mut command = tokio::process::Command::new("docker");
    command.args(["run", "--rm", "-i", "--network", "host", "--name", &name]);
    if let Ok(run) = std::env::var("IDEMPOTENCY_TEST_RUN_ID") {
        // scripts/test.sh sweeps its run's containers by this label.
        command.args(["--label", &format!("org.idempotency-rs.run={run}")]);
    }
    command
        .args(["--env", "NO_PROXY=*", "--env", "no_proxy=*", &image, "-"])
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    let mut child = command.spawn().expect("the docker CLI runs");
    let mut stdin = child.stdin.take().unwrap();
    stdin.write_all(script.as_bytes()).await.unwrap();
    drop(stdin);
    let output = match tokio::time::timeout(SCRIPT_TIMEOUT, child.wait_with_output()).await {
        Ok(output) => output.expect("docker run ran"),
        Err(_) => {
            remove_container(&name).await;
            panic!("the client script did not end within {SCRIPT_TIMEOUT:?} (container {name} removed)");
        }
    };
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "the client script failed ({}):\n{stderr}\n{stdout}",
        output.status
    );
    let last = stdout.lines().last().unwrap_or_default();
    serde_json::from_str(last)
        .unwrap_or_else(|e| panic!("the client script printed no JSON ({e}):\n{stdout}\n{stderr}"))
}

async fn remove_container(name: &str) {
    let _ = tokio::process::Command::new("docker")
        .args(["rm", "-f", name])
        .output()
        .await;
}

/// Fails, saying how to get it, unless the engine has `image`.
async fn ensure_image(image: &str) {
    let output = tokio::process::Command::new("docker")
        .args(["image", "inspect", "--format", "{{.Id}}", image])
        .output()
        .await;
    let how = format!(
        "bake it from Debian packages with `sudo scripts/bake-images.sh python-clients` \
         (`scripts/test.sh` does it when it is missing) and set \
         {IMAGE_VARIABLE}={BAKED_IMAGE} (or any image with python3, requests and stripe)"
    );
    match output {
        Err(e) => panic!(
            "no HTTP client image for the tests: the docker CLI did not run ({e}); \
             these tests run real clients in a container. Install Docker, then {how}"
        ),
        Ok(out) if out.status.success() => {}
        Ok(out) => {
            let stderr = String::from_utf8_lossy(&out.stderr);
            if stderr.to_ascii_lowercase().contains("no such image") {
                panic!("no HTTP client image for the tests: `{image}` is not present; {how}");
            }
            panic!(
                "no HTTP client image for the tests: Docker is not reachable ({}); \
                 these tests run real clients in a container: run a Docker engine, then {how}",
                stderr.trim()
            );
        }
    }
}
