//! A closed coordinator lets go of its ports: a restart on the same port binds them.

use mcp_core::membership::coordinator::CoordinatorConfig;
use mcp_core::membership::server::CoordinatorServer;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_closed_coordinator_frees_both_its_ports_at_once() {
    for round in 0..20 {
        let c = CoordinatorServer::start(
            "127.0.0.1:0".parse().expect("addr"),
            b"secret",
            CoordinatorConfig::default(),
        )
        .expect("start");
        let addr = c.local_addr();
        c.close().await;
        std::net::TcpListener::bind(addr)
            .unwrap_or_else(|e| panic!("round {round}: TCP port {addr} still taken: {e}"));
        let again = CoordinatorServer::start(addr, b"secret", CoordinatorConfig::default())
            .unwrap_or_else(|e| panic!("round {round}: restart on {addr}: {e}"));
        again.close().await;
    }
}
