//! The shard map: which server holds which part of which tensor.
//!
//! Deterministic: every worker builds the same map from the same tensor list and number of
//! server slots. Tensors are taken in name order; a tensor above `split_above` elements is
//! cut into one contiguous range per server (multiples of 16 elements), the others go whole
//! to the least-loaded server (by elements; ties to the lowest slot). A slot is a position in
//! the versioned server list ([`ServerList`]): when a server is replaced (a standby restored
//! from its checkpoint), its slot keeps its pieces and only the address changes.

use crate::error::{Error, Result};
use std::collections::BTreeMap;

/// Range alignment of split tensors, in elements.
const ALIGN: u64 = 16;

/// One contiguous range of a tensor, held by one server slot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Piece {
    /// Tensor name.
    pub key: String,
    /// First element of the range.
    pub offset: u64,
    /// Elements in the range.
    pub len: u64,
    /// Server slot that holds it.
    pub server: usize,
}

/// Keys and ranges to server slots.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardMap {
    servers: usize,
    pieces: BTreeMap<String, Vec<Piece>>,
    numel: BTreeMap<String, u64>,
}

impl ShardMap {
    /// Builds the map of `tensors` (name, elements) over `servers` slots.
    pub fn build(servers: usize, tensors: &[(String, u64)], split_above: u64) -> Result<ShardMap> {
        if servers == 0 {
            return Err(Error::InvalidArgument(
                "at least one server is needed".into(),
            ));
        }
        let mut sorted: Vec<&(String, u64)> = tensors.iter().collect();
        sorted.sort_by(|a, b| a.0.cmp(&b.0));
        if let Some(w) = sorted.windows(2).find(|w| w[0].0 == w[1].0) {
            return Err(Error::InvalidArgument(format!(
                "tensor name {:?} given twice",
                w[0].0
            )));
        }
        let mut load = vec![0u64; servers];
        let mut pieces = BTreeMap::new();
        let mut numel = BTreeMap::new();
        for (name, n) in sorted {
            let n = *n;
            numel.insert(name.clone(), n);
            let least = (0..servers).min_by_key(|&s| (load[s], s)).unwrap_or(0);
            let mut ps = Vec::new();
            if servers > 1 && n > split_above {
                let per = n.div_ceil(servers as u64).div_ceil(ALIGN) * ALIGN;
                let mut offset = 0;
                let mut i = 0;
                while offset < n {
                    let len = per.min(n - offset);
                    let server = (least + i) % servers;
                    load[server] += len;
                    ps.push(Piece {
                        key: name.clone(),
                        offset,
                        len,
                        server,
                    });
                    offset += len;
                    i += 1;
                }
            } else {
                load[least] += n;
                ps.push(Piece {
                    key: name.clone(),
                    offset: 0,
                    len: n,
                    server: least,
                });
            }
            pieces.insert(name.clone(), ps);
        }
        Ok(ShardMap {
            servers,
            pieces,
            numel,
        })
    }

    /// Number of server slots.
    pub fn servers(&self) -> usize {
        self.servers
    }

    /// The pieces of `key`, in offset order.
    pub fn pieces(&self, key: &str) -> Result<&[Piece]> {
        self.pieces.get(key).map(|v| v.as_slice()).ok_or_else(|| {
            Error::InvalidArgument(format!(
                "no tensor named {key:?} in the parameter server's map"
            ))
        })
    }

    /// Elements of `key`.
    pub fn numel(&self, key: &str) -> Option<u64> {
        self.numel.get(key).copied()
    }

    /// Every piece, tensor by tensor.
    pub fn all(&self) -> impl Iterator<Item = &Piece> {
        self.pieces.values().flatten()
    }

    /// Elements held by each slot.
    pub fn load(&self) -> Vec<u64> {
        let mut l = vec![0; self.servers];
        for p in self.all() {
            l[p.server] += p.len;
        }
        l
    }
}

/// The servers' addresses by slot, with a version that goes up at every change.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerList {
    /// Bumped each time an address changes.
    pub version: u64,
    /// Address of each slot.
    pub addrs: Vec<std::net::SocketAddr>,
}

impl ServerList {
    /// Version 0 of a list.
    pub fn new(addrs: Vec<std::net::SocketAddr>) -> ServerList {
        ServerList { version: 0, addrs }
    }

    /// Replaces the server of `slot` (a standby took over) and bumps the version.
    pub fn replace(&mut self, slot: usize, addr: std::net::SocketAddr) -> Result<()> {
        let n = self.addrs.len();
        let a = self
            .addrs
            .get_mut(slot)
            .ok_or_else(|| Error::InvalidArgument(format!("no server slot {slot} among {n}")))?;
        *a = addr;
        self.version += 1;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(v: &[(&str, u64)]) -> Vec<(String, u64)> {
        v.iter().map(|(n, k)| (n.to_string(), *k)).collect()
    }

    #[test]
    fn whole_tensors_are_balanced_and_deterministic() {
        let ts = t(&[("b", 100), ("a", 300), ("c", 50), ("d", 10)]);
        let m = ShardMap::build(2, &ts, 1 << 20).expect("map");
        // name order: a(300)->0, b(100)->1, c(50)->1, d(10)->1
        let slot = |k: &str| m.pieces(k).expect("key")[0].server;
        assert_eq!([slot("a"), slot("b"), slot("c"), slot("d")], [0, 1, 1, 1]);
        assert_eq!(m.load(), vec![300, 160]);
        let mut rev = ts.clone();
        rev.reverse();
        assert_eq!(ShardMap::build(2, &rev, 1 << 20).expect("map"), m);
    }

    #[test]
    fn large_tensors_are_split_across_servers() {
        let m = ShardMap::build(3, &t(&[("w", 1000)]), 100).expect("map");
        let ps = m.pieces("w").expect("w");
        assert_eq!(ps.len(), 3);
        assert_eq!(
            ps.iter()
                .map(|p| (p.offset, p.len, p.server))
                .collect::<Vec<_>>(),
            vec![(0, 336, 0), (336, 336, 1), (672, 328, 2)]
        );
        assert_eq!(ps.iter().map(|p| p.len).sum::<u64>(), 1000);
        // a tiny tensor above the threshold still covers itself exactly
        let m = ShardMap::build(4, &t(&[("x", 20)]), 10).expect("map");
        let ps = m.pieces("x").expect("x");
        assert_eq!(ps.iter().map(|p| p.len).sum::<u64>(), 20);
        assert!(ps.iter().all(|p| p.len > 0));
    }

    #[test]
    fn errors() {
        assert!(ShardMap::build(0, &t(&[("a", 1)]), 10).is_err());
        assert!(ShardMap::build(1, &t(&[("a", 1), ("a", 2)]), 10).is_err());
        let m = ShardMap::build(1, &t(&[("a", 1)]), 10).expect("map");
        assert!(matches!(m.pieces("zz"), Err(Error::InvalidArgument(_))));
    }

    #[test]
    fn replacing_a_server_keeps_the_layout_and_bumps_the_version() {
        let a: std::net::SocketAddr = "127.0.0.1:1000".parse().expect("addr");
        let b: std::net::SocketAddr = "127.0.0.1:2000".parse().expect("addr");
        let mut l = ServerList::new(vec![a, a]);
        l.replace(1, b).expect("replace");
        assert_eq!((l.version, l.addrs[1]), (1, b));
        assert!(l.replace(5, b).is_err());
    }
}
