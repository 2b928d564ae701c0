//! Which host a rank runs on: an identity every rank computes at start and sends at the
//! rendezvous, and the per-rank host indices that follow from everyone's.
//!
//! The identity is the host name, the network namespace (the inode of `/proc/self/ns/net`:
//! two namespaces on one machine are two hosts, which is how multi-host runs are tested here,
//! and processes in different namespaces cannot reach each other's abstract Unix sockets
//! anyway) and the boot id (a machine restored from an image keeps its name, not its boot
//! id). `MCP_HOST_ID` replaces it: ranks with the same value count as one host. torchrun's
//! `LOCAL_RANK` is not consulted: it says what the launcher intended, not where processes ran.

use crate::error::{Error, Result};

/// Longest host identity accepted.
pub const MAX_HOST_ID: usize = 200;

/// Checks a host identity: 1 to [`MAX_HOST_ID`] printable ASCII characters, no spaces (it
/// travels in a space-separated table).
pub fn check_host_id(id: &str) -> Result<()> {
    if id.is_empty() || id.len() > MAX_HOST_ID || !id.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(Error::InvalidArgument(format!(
            "host id (MCP_HOST_ID) must be 1 to {MAX_HOST_ID} printable ASCII characters without spaces, got {id:?}"
        )));
    }
    Ok(())
}

fn clean(s: &str) -> String {
    let s: String = s
        .trim()
        .chars()
        .map(|c| if c.is_ascii_graphic() { c } else { '_' })
        .collect();
    if s.is_empty() {
        "?".into()
    } else {
        s
    }
}

/// This process's host identity: `MCP_HOST_ID` when set (checked), else
/// `<hostname>/netns:<inode>/boot:<boot id>`.
pub fn local_host_id() -> Result<String> {
    if let Ok(id) = std::env::var("MCP_HOST_ID") {
        check_host_id(&id)?;
        return Ok(id);
    }
    use std::os::unix::fs::MetadataExt;
    let name = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    let netns = std::fs::metadata("/proc/self/ns/net")
        .map(|m| m.ino().to_string())
        .unwrap_or_else(|_| "?".into());
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default();
    let mut id = format!("{}/netns:{netns}/boot:{}", clean(&name), clean(&boot));
    id.truncate(MAX_HOST_ID);
    Ok(id)
}

/// Host index of every rank, hosts numbered in order of first appearance by rank (rank 0 is
/// on host 0).
pub fn host_indices<S: AsRef<str>>(ids: &[S]) -> Vec<usize> {
    let mut seen: Vec<&str> = Vec::new();
    ids.iter()
        .map(|id| {
            let id = id.as_ref();
            match seen.iter().position(|s| *s == id) {
                Some(i) => i,
                None => {
                    seen.push(id);
                    seen.len() - 1
                }
            }
        })
        .collect()
}

/// The ranks of each host, in host order, each list ascending.
pub fn ranks_by_host(host_of_rank: &[usize]) -> Vec<Vec<usize>> {
    let hosts = host_of_rank.iter().max().map_or(0, |m| m + 1);
    let mut out = vec![Vec::new(); hosts];
    for (r, &h) in host_of_rank.iter().enumerate() {
        out[h].push(r);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hosts_are_numbered_by_first_appearance() {
        assert_eq!(
            host_indices(&["b", "a", "b", "c", "a"]),
            vec![0, 1, 0, 2, 1]
        );
        assert_eq!(host_indices::<&str>(&[]), Vec::<usize>::new());
        assert_eq!(
            ranks_by_host(&[0, 1, 0, 2, 1]),
            vec![vec![0, 2], vec![1, 4], vec![3]]
        );
    }

    #[test]
    fn the_computed_identity_names_the_network_namespace() {
        if std::env::var("MCP_HOST_ID").is_ok() {
            return;
        }
        let id = local_host_id().expect("host id");
        assert!(id.contains("/netns:") && id.contains("/boot:"), "{id}");
        check_host_id(&id).expect("a computed id passes its own check");
    }

    #[test]
    fn bad_host_ids_are_refused() {
        for bad in ["", "a b", "tab\there", &"x".repeat(MAX_HOST_ID + 1), "é"] {
            assert!(
                matches!(check_host_id(bad), Err(Error::InvalidArgument(_))),
                "{bad:?}"
            );
        }
        check_host_id("node-7").expect("a plain name");
    }
}
