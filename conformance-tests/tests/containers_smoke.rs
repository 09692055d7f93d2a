//! Smoke tests of the container harness itself: each server starts and answers
//! its client, namespaces are isolated, a dedicated container comes back after
//! a stop, and without a server the harness fails loudly with instructions.
//!
//! Run with `cargo test -p idempotency-conformance --features containers --test
//! containers_smoke -- --nocapture` to see which images and ports are used.
#![cfg(feature = "containers")]
#![allow(clippy::expect_used, clippy::unwrap_used)]

use idempotency_conformance::containers::{
    self, tokio_postgres, DynamoDbServer, Origin, PostgresServer, RedisReply, RedisServer,
};

fn describe(kind: &str, address: &str, origin: &Origin) {
    println!("{kind}: {address} — {origin}");
}

fn bulk(text: &str) -> RedisReply {
    RedisReply::Bulk(Some(text.as_bytes().to_vec()))
}

async fn redis() -> RedisServer {
    containers::redis()
        .await
        .expect("a Redis server for the smoke test")
}

async fn postgres() -> PostgresServer {
    containers::postgres()
        .await
        .expect("a PostgreSQL server for the smoke test")
}

async fn dynamodb() -> DynamoDbServer {
    containers::dynamodb()
        .await
        .expect("a DynamoDB-compatible server for the smoke test")
}

#[tokio::test]
async fn redis_answers_ping() {
    let server = redis().await;
    describe("redis", server.url(), server.origin());
    assert_eq!(
        server.command(&["PING"]).await.expect("PING"),
        RedisReply::Status("PONG".into())
    );
}

#[tokio::test]
async fn postgres_answers_select_1() {
    let server = postgres().await;
    describe("postgres", server.url(), server.origin());
    let client = server.client().await.expect("connect");
    let row = client.query_one("SELECT 1", &[]).await.expect("SELECT 1");
    assert_eq!(row.get::<_, i32>(0), 1);
}

#[tokio::test]
async fn dynamodb_answers_list_tables() {
    let server = dynamodb().await;
    describe("dynamodb", server.endpoint(), server.origin());
    let response = server.call("ListTables", "{}").await.expect("ListTables");
    assert_eq!(response.status, 200, "{}", response.body);
    assert!(response.body.contains("TableNames"), "{}", response.body);
}

#[tokio::test]
async fn the_shared_server_is_the_same_for_every_test() {
    let (a, b) = (redis().await, redis().await);
    assert_eq!(a, b);
}

#[tokio::test]
async fn redis_namespaces_do_not_see_each_other() {
    let server = redis().await;
    let (one, two) = (
        containers::unique_namespace("smoke"),
        containers::unique_namespace("smoke"),
    );
    let key = |ns: &str| format!("{ns}:key");
    assert_eq!(
        server
            .command(&["SET", &key(&one), "from-one"])
            .await
            .unwrap(),
        RedisReply::Status("OK".into())
    );
    assert_eq!(
        server.command(&["GET", &key(&two)]).await.unwrap(),
        RedisReply::Bulk(None)
    );
    assert_eq!(
        server
            .command(&["KEYS", &format!("{two}:*")])
            .await
            .unwrap(),
        RedisReply::Array(Some(vec![]))
    );
    assert_eq!(
        server.command(&["GET", &key(&one)]).await.unwrap(),
        bulk("from-one")
    );
}

#[tokio::test]
async fn postgres_schemas_do_not_see_each_other() {
    let server = postgres().await;
    let (one, two) = (
        server.create_schema().await.expect("schema one"),
        server.create_schema().await.expect("schema two"),
    );
    assert_ne!(one, two);
    for schema in [&one, &two] {
        let (client, connection) =
            tokio_postgres::connect(&server.url_with_schema(schema), tokio_postgres::NoTls)
                .await
                .expect("connect with a search path");
        tokio::spawn(connection);
        client
            .batch_execute("CREATE TABLE records (id text PRIMARY KEY)")
            .await
            .expect("an unqualified table lands in the search-path schema");
        if schema == &one {
            client
                .batch_execute("INSERT INTO records VALUES ('only-in-one')")
                .await
                .unwrap();
        }
    }
    let client = server.client().await.unwrap();
    let count = |schema: String| {
        let client = &client;
        async move {
            client
                .query_one(&format!("SELECT count(*) FROM \"{schema}\".records"), &[])
                .await
                .unwrap()
                .get::<_, i64>(0)
        }
    };
    assert_eq!(count(one.clone()).await, 1);
    assert_eq!(count(two.clone()).await, 0);
    server.drop_schema(&one).await.unwrap();
    server.drop_schema(&two).await.unwrap();
}

#[tokio::test]
async fn dynamodb_tables_do_not_see_each_other() {
    let server = dynamodb().await;
    let (one, two) = (
        server.unique_table_name("smoke"),
        server.unique_table_name("smoke"),
    );
    for table in [&one, &two] {
        let response = server
            .call(
                "CreateTable",
                &format!(
                    r#"{{"TableName":"{table}","AttributeDefinitions":[{{"AttributeName":"pk","AttributeType":"S"}}],"KeySchema":[{{"AttributeName":"pk","KeyType":"HASH"}}],"BillingMode":"PAY_PER_REQUEST"}}"#
                ),
            )
            .await
            .unwrap();
        assert_eq!(response.status, 200, "CreateTable: {}", response.body);
    }
    let put = server
        .call(
            "PutItem",
            &format!(r#"{{"TableName":"{one}","Item":{{"pk":{{"S":"only-in-one"}}}}}}"#),
        )
        .await
        .unwrap();
    assert_eq!(put.status, 200, "PutItem: {}", put.body);
    let scan = |table: String| {
        let server = &server;
        async move {
            let response = server
                .call("Scan", &format!(r#"{{"TableName":"{table}"}}"#))
                .await
                .unwrap();
            assert_eq!(response.status, 200, "Scan: {}", response.body);
            response.body
        }
    };
    assert!(scan(one.clone()).await.contains("only-in-one"));
    assert!(!scan(two.clone()).await.contains("only-in-one"));
    for table in [&one, &two] {
        let _ = server
            .call("DeleteTable", &format!(r#"{{"TableName":"{table}"}}"#))
            .await;
    }
}

#[tokio::test]
async fn a_dedicated_redis_is_reachable_again_after_a_restart() {
    let server = RedisServer::dedicated().await.expect("a dedicated Redis");
    describe("redis (dedicated)", server.url(), server.origin());
    assert_ne!(server.url(), redis().await.url(), "not the shared server");
    let url = server.url().to_owned();
    server.command(&["SET", "survivor", "yes"]).await.unwrap();

    server.stop().await.expect("stop");
    assert!(
        server.command(&["PING"]).await.is_err(),
        "a stopped server must be unreachable"
    );
    server.start().await.expect("start again");

    assert_eq!(server.url(), url, "same URL after the restart");
    assert_eq!(
        server.command(&["PING"]).await.unwrap(),
        RedisReply::Status("PONG".into())
    );
    server.remove().await.expect("remove");
}

#[tokio::test]
async fn a_dedicated_postgres_is_reachable_again_after_a_restart() {
    let server = PostgresServer::dedicated()
        .await
        .expect("a dedicated PostgreSQL");
    describe("postgres (dedicated)", server.url(), server.origin());
    let client = server.client().await.unwrap();
    client
        .batch_execute("CREATE TABLE survivor (x int); INSERT INTO survivor VALUES (7)")
        .await
        .unwrap();

    server.stop().await.expect("stop");
    assert!(
        client.query_one("SELECT 1", &[]).await.is_err(),
        "the old connection breaks during the outage"
    );
    assert!(
        server.client().await.is_err(),
        "no new connections while stopped"
    );
    server.start().await.expect("start again");

    let client = server.client().await.expect("reconnect to the same URL");
    let row = client
        .query_one("SELECT x FROM survivor", &[])
        .await
        .unwrap();
    assert_eq!(row.get::<_, i32>(0), 7, "data survives a restart");
}

#[tokio::test]
async fn a_dedicated_dynamodb_is_reachable_again_after_a_restart() {
    let server = DynamoDbServer::dedicated()
        .await
        .expect("a dedicated DynamoDB-compatible server");
    describe("dynamodb (dedicated)", server.endpoint(), server.origin());
    server.stop().await.expect("stop");
    assert!(server.call("ListTables", "{}").await.is_err());
    server.start().await.expect("start again");
    let response = server.call("ListTables", "{}").await.unwrap();
    assert_eq!(response.status, 200, "{}", response.body);
}

#[tokio::test]
async fn a_redis_cluster_has_three_masters_and_redirects_to_reachable_nodes() {
    let cluster = containers::redis_cluster()
        .await
        .expect("a Redis Cluster for the smoke test");
    assert_eq!(cluster.nodes().len(), 3);
    for node in cluster.nodes() {
        describe("redis cluster node", node.url(), node.origin());
        let RedisReply::Bulk(Some(info)) = node.command(&["CLUSTER", "INFO"]).await.unwrap() else {
            panic!("CLUSTER INFO is a bulk string");
        };
        let info = String::from_utf8_lossy(&info);
        assert!(info.contains("cluster_state:ok"), "{info}");
        assert!(info.contains("cluster_slots_assigned:16384"), "{info}");
    }
    // Keys land on different masters; a MOVED redirection names an address the
    // tests can reach.
    let key = containers::unique_namespace("cluster");
    let first = &cluster.nodes()[0];
    let reply = first.command(&["SET", &key, "v"]).await.unwrap();
    let owner = match reply {
        RedisReply::Status(ok) if ok == "OK" => first.clone(),
        RedisReply::Error(moved) if moved.starts_with("MOVED") => {
            let address = moved
                .split_whitespace()
                .nth(2)
                .expect("MOVED <slot> <host:port>");
            cluster
                .nodes()
                .iter()
                .find(|node| address == format!("{}:{}", node.host(), node.port()))
                .unwrap_or_else(|| panic!("{address} is none of the harness's nodes"))
                .clone()
        }
        other => panic!("unexpected SET reply {other:?}"),
    };
    if owner.port() != first.port() {
        assert_eq!(
            owner.command(&["SET", &key, "v"]).await.unwrap(),
            RedisReply::Status("OK".into())
        );
    }
    assert_eq!(owner.command(&["GET", &key]).await.unwrap(), bulk("v"));
}

/// Runs one of this binary's tests in a child process whose Docker is
/// unreachable and which has no server variables: it must fail, and say how to
/// provide a server.
#[test]
fn without_docker_and_variables_tests_fail_with_instructions() {
    if std::env::var_os("IDEMPOTENCY_SMOKE_CHILD").is_some() {
        return; // already the child; never recurse
    }
    let exe = std::env::current_exe().expect("the test binary's path");
    let output = std::process::Command::new(exe)
        .args([
            "--exact",
            "redis_answers_ping",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("IDEMPOTENCY_SMOKE_CHILD", "1")
        .env("DOCKER_HOST", "unix:///nonexistent/idempotency-smoke.sock")
        .env_remove("IDEMPOTENCY_TEST_REDIS_URL")
        .output()
        .expect("run the child test");
    // Indented, so the child's `test result:` lines never look like ours.
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
    .replace('\n', "\n    ");
    assert!(!output.status.success(), "the child must fail:\n{text}");
    for needle in [
        "Docker is not reachable",
        "IDEMPOTENCY_TEST_REDIS_URL=redis://",
        "scripts/bake-images.sh",
    ] {
        assert!(text.contains(needle), "{needle:?} missing in:\n{text}");
    }
}
