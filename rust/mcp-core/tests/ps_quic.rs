//! The parameter server end to end over real QUIC sockets on 127.0.0.1, all in one process:
//! registration, split tensors across two servers, push / advance / pull at s = 0, the
//! one-round-trip step, refusal of a worker without the job secret, and replacements that
//! claim a vacant worker id.

use mcp_core::ps::sgd::SgdConfig;
use mcp_core::ps::{ClientConfig, Optimizer, PsClient, PsServer, ServerConfig};
use mcp_core::wire::Codec;
use mcp_core::{Error, RawBuf};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

const SECRET: &[u8] = b"ps integration secret";

async fn server(workers: usize) -> PsServer {
    let mut cfg = ServerConfig::new("127.0.0.1:0".parse().expect("addr"), SECRET.to_vec());
    cfg.optimizer = Optimizer::Sgd(SgdConfig {
        lr: 0.5,
        momentum: 0.0,
        weight_decay: 0.0,
        nesterov: false,
    });
    cfg.staleness = 0;
    cfg.num_workers = workers;
    cfg.dead_after = Duration::from_secs(2);
    PsServer::start(cfg).await.expect("server")
}

fn client(servers: Vec<SocketAddr>, worker: u32, secret: &[u8]) -> ClientConfig {
    ClientConfig {
        servers,
        worker: Some(worker),
        secret: secret.to_vec(),
        timeout: Duration::from_secs(10),
        dead_after: Duration::from_secs(2),
        split_above: 64,
        chaos: None,
        transport: Default::default(),
    }
}

fn bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn floats(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

/// One worker's run: init, then two clocks (separate calls, then the fused step).
async fn run(c: Arc<PsClient>, w: u32) -> (Vec<f32>, Vec<f32>) {
    let n = 200;
    c.set_tensors(&[("x".to_string(), n as u64)]).expect("map");
    let mut init = bytes(&vec![1.0; n]);
    // SAFETY: `init` outlives the awaited call and nothing else touches it.
    let ib = unsafe { RawBuf::from_slice(&mut init) };
    c.init_all(vec![("x".into(), ib)]).await.expect("init");
    let mut grad = bytes(&vec![(w + 1) as f32; n]);
    // SAFETY: as above.
    let gb = unsafe { RawBuf::from_slice(&mut grad) };
    c.push_all(vec![("x".into(), gb)], Codec::None)
        .await
        .expect("push");
    let info = c.advance(None).await.expect("advance");
    assert_eq!((info.clock, info.min), (1, Some(1)));
    let mut out = vec![0u8; n * 4];
    // SAFETY: as above.
    let ob = unsafe { RawBuf::from_slice(&mut out) };
    c.pull_all(vec![("x".into(), ob)]).await.expect("pull");
    let after_one = floats(&out);
    let info = c
        .step_all(
            vec![("x".into(), gb)],
            vec![("x".into(), ob)],
            Codec::None,
            None,
        )
        .await
        .expect("step");
    assert_eq!(info.clock, 2);
    (after_one, floats(&out))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_servers_two_workers_at_s0() {
    let (s0, s1) = (server(2).await, server(2).await);
    let addrs = vec![
        s0.local_addr().expect("addr"),
        s1.local_addr().expect("addr"),
    ];
    let (a, b) = tokio::join!(
        PsClient::connect(client(addrs.clone(), 0, SECRET)),
        PsClient::connect(client(addrs.clone(), 1, SECRET))
    );
    let (a, b) = (a.expect("worker 0"), b.expect("worker 1"));
    let (ra, rb) = tokio::join!(run(a.clone(), 0), run(b.clone(), 1));
    // mean gradient 1.5, lr 0.5: 1 - 0.75 = 0.25, then 0.25 - 0.75 = -0.5, on every element
    for r in [&ra, &rb] {
        assert!(r.0.iter().all(|&x| x == 0.25), "{:?}", &r.0[..4]);
        assert!(r.1.iter().all(|&x| x == -0.5), "{:?}", &r.1[..4]);
    }
    let stats = a.stats().await.expect("stats");
    let get = |kv: &Vec<(String, u64)>, k: &str| {
        kv.iter()
            .find(|(n, _)| n == k)
            .map(|(_, v)| *v)
            .expect("key")
    };
    assert_eq!(stats.len(), 2);
    assert!(
        stats.iter().all(|kv| get(kv, "pieces") == 1),
        "x is split across both"
    );
    assert!(stats.iter().all(|kv| get(kv, "clocks_applied") == 2));
    a.close().await;
    b.close().await;
    s0.close().await;
    s1.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_without_the_secret_is_refused() {
    let s = server(1).await;
    let addr = s.local_addr().expect("addr");
    let r = PsClient::connect(client(vec![addr], 0, b"wrong")).await;
    assert!(
        matches!(r, Err(Error::Authentication { .. })),
        "{:?}",
        r.err()
    );
    s.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forgotten_worker_registers_again_on_its_connection() {
    let s = server(1).await;
    let addr = s.local_addr().expect("addr");
    let a = PsClient::connect(client(vec![addr], 0, SECRET))
        .await
        .expect("a");
    a.set_tensors(&[("x".to_string(), 8)]).expect("map");
    let mut init = bytes(&[0.0; 8]);
    // SAFETY: `init` outlives the awaited calls and nothing else touches it.
    let ib = unsafe { RawBuf::from_slice(&mut init) };
    a.init_all(vec![("x".into(), ib)]).await.expect("init");
    // Another process takes worker id 0 and leaves: the server drops worker 0.
    let b = PsClient::connect(client(vec![addr], 0, SECRET))
        .await
        .expect("b");
    b.close().await;
    assert_eq!(s.clocks(), vec![(0, 0, false)]);
    // `a` is told it is not live, registers again on the same connection and goes on.
    let mut grad = bytes(&[2.0; 8]);
    // SAFETY: as above.
    let gb = unsafe { RawBuf::from_slice(&mut grad) };
    a.push_all(vec![("x".into(), gb)], Codec::None)
        .await
        .expect("push");
    assert_eq!(a.advance(None).await.expect("advance").clock, 1);
    assert!(
        a.counters().0 >= 1,
        "the push was retried after registering again"
    );
    assert_eq!(a.counters().1, 0, "on the same connection");
    a.pull_all(vec![("x".into(), ib)]).await.expect("pull");
    assert!(
        floats(&init).iter().all(|&x| x == -1.0),
        "{:?}",
        floats(&init)
    );
    a.close().await;
    s.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replacement_claims_the_vacant_id_on_every_server_and_the_old_one_is_fenced() {
    let (s0, s1) = (server(2).await, server(2).await);
    let addrs = vec![
        s0.local_addr().expect("addr"),
        s1.local_addr().expect("addr"),
    ];
    let spare = |timeout: Duration| ClientConfig {
        worker: None,
        timeout,
        ..client(addrs.clone(), 0, SECRET)
    };
    // Worker 0 by its id, then a second process without one: it gets id 1, the one never
    // taken (a spare that came first would take id 0, the lowest never registered).
    let first = tokio::spawn(PsClient::connect(client(addrs.clone(), 0, SECRET)));
    for _ in 0..500 {
        if s0.clocks().iter().any(|e| e.0 == 0) && s1.clocks().iter().any(|e| e.0 == 0) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let b = PsClient::connect(spare(Duration::from_secs(10)))
        .await
        .expect("spare");
    let a = first.await.expect("task").expect("worker 0");
    assert_eq!((b.worker(), b.generation()), (1, 1));
    let (ra, rb) = tokio::join!(run(a.clone(), 0), run(b.clone(), 1));
    assert_eq!(ra, rb, "both hold the same parameters");
    assert!(ra.1.iter().all(|&x| x == -0.5), "{:?}", &ra.1[..4]);
    // Nothing is vacant while both are live: a third waits, then times out, naming why.
    let r = PsClient::connect(spare(Duration::from_millis(1500))).await;
    match r {
        Err(Error::Timeout { what, .. }) => assert!(what.contains("no vacant worker id"), "{what}"),
        other => panic!("expected a timeout, got {:?}", other.err()),
    }
    // Worker 1 dies (its connections close without a goodbye): a waiting spare takes its id,
    // generation 2, at the slowest live clock, on both servers.
    let waiting = tokio::spawn(PsClient::connect(spare(Duration::from_secs(10))));
    drop(b);
    let c = waiting.await.expect("task").expect("replacement");
    assert_eq!((c.worker(), c.generation(), c.clock()), (1, 2, 2));
    for s in [&s0, &s1] {
        assert!(s.clocks().contains(&(1, 2, true)), "{:?}", s.clocks());
    }
    // A process that holds id 1 by number (generation 0, like the dead one had) is refused.
    let old = PsClient::connect(client(addrs.clone(), 1, SECRET)).await;
    assert!(
        matches!(&old, Err(Error::Superseded(m)) if m.contains("taken over")),
        "{:?}",
        old.err()
    );
    // A worker that leaves is done: its id is not vacant.
    a.close().await;
    let r = PsClient::connect(spare(Duration::from_millis(800))).await;
    assert!(matches!(r, Err(Error::Timeout { .. })), "{:?}", r.err());
    c.close().await;
    s0.close().await;
    s1.close().await;
}
