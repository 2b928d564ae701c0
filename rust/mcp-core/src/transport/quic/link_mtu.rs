//! The MTU of the network interface a socket is bound on, so that MTU discovery may climb to
//! jumbo frames where the host has them (9,000 bytes on many data-centre networks, 9,001 on
//! AWS) instead of stopping at quinn's 1,452 bytes: per-packet work is what limits QUIC, and
//! a 9,000-byte packet carries six times the data of a 1,500-byte one for about the same work.

use std::net::IpAddr;

/// Links of at most this MTU keep quinn's own discovery ceiling (1,452 bytes: safe under
/// tunnels and IPv6 on 1,500-byte Ethernet).
pub(crate) const ETHERNET_MTU: u32 = 1500;
/// The largest UDP payload we let discovery probe for on any link.
const MAX_PAYLOAD: u32 = 65_000;

/// The largest UDP payload MTU discovery should probe for on a link of `link_mtu` bytes
/// reached over `ip`'s family, or `None` for an ordinary link (quinn's default ceiling).
pub(crate) fn discovery_ceiling(ip: IpAddr, link_mtu: u32) -> Option<u16> {
    if link_mtu <= ETHERNET_MTU {
        return None;
    }
    let headers = if ip.is_ipv4() { 20 + 8 } else { 40 + 8 };
    let payload = link_mtu.saturating_sub(headers).min(MAX_PAYLOAD);
    u16::try_from(payload).ok()
}

/// The MTU of the interface that holds address `ip`, when the system says (Linux: the
/// interface found through `getifaddrs`, its MTU read from sysfs).
#[cfg(target_os = "linux")]
pub(crate) fn interface_mtu(ip: IpAddr) -> Option<u32> {
    let name = interface_of(ip)?;
    let text = std::fs::read_to_string(format!("/sys/class/net/{name}/mtu")).ok()?;
    text.trim().parse().ok()
}

/// The MTU of the interface that holds address `ip`: unknown on this system.
#[cfg(not(target_os = "linux"))]
pub(crate) fn interface_mtu(_ip: IpAddr) -> Option<u32> {
    None
}

/// The name of the interface that holds address `ip`.
#[cfg(target_os = "linux")]
fn interface_of(ip: IpAddr) -> Option<String> {
    if ip.is_unspecified() || ip.is_loopback() {
        return None;
    }
    let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: `head` is a valid out-pointer; on success the list it receives is freed below
    // with `freeifaddrs`, once, after the last read of it.
    if unsafe { libc::getifaddrs(&mut head) } != 0 {
        return None;
    }
    let mut found = None;
    let mut cur = head;
    while !cur.is_null() && found.is_none() {
        // SAFETY: `cur` is a node of the list `getifaddrs` returned, not yet freed.
        let ifa = unsafe { &*cur };
        cur = ifa.ifa_next;
        if ifa.ifa_addr.is_null() || ifa.ifa_name.is_null() {
            continue;
        }
        // SAFETY: `ifa_addr` is non-null and points at a sockaddr whose `sa_family` says
        // which sockaddr it is; each is read as that type only.
        let addr = unsafe {
            match i32::from((*ifa.ifa_addr).sa_family) {
                libc::AF_INET => {
                    let sin = &*ifa.ifa_addr.cast::<libc::sockaddr_in>();
                    Some(IpAddr::from(
                        u32::from_be(sin.sin_addr.s_addr).to_be_bytes(),
                    ))
                }
                libc::AF_INET6 => {
                    let sin6 = &*ifa.ifa_addr.cast::<libc::sockaddr_in6>();
                    Some(IpAddr::from(sin6.sin6_addr.s6_addr))
                }
                _ => None,
            }
        };
        if addr == Some(ip) {
            // SAFETY: `ifa_name` is a non-null, NUL-terminated string owned by the list.
            let name = unsafe { std::ffi::CStr::from_ptr(ifa.ifa_name) };
            found = Some(name.to_string_lossy().into_owned());
        }
    }
    // SAFETY: `head` came from a successful `getifaddrs` and is freed once; nothing read
    // from the list outlives this call (the name was copied).
    unsafe { libc::freeifaddrs(head) };
    found
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::{Ipv4Addr, Ipv6Addr};

    #[test]
    fn jumbo_links_raise_the_ceiling_ordinary_ones_keep_quinns() {
        let v4 = IpAddr::V4(Ipv4Addr::new(10, 0, 0, 1));
        let v6 = IpAddr::V6(Ipv6Addr::new(0xfd00, 0, 0, 0, 0, 0, 0, 1));
        assert_eq!(discovery_ceiling(v4, 1500), None);
        assert_eq!(discovery_ceiling(v4, 1460), None);
        assert_eq!(discovery_ceiling(v4, 9000), Some(8972));
        assert_eq!(discovery_ceiling(v4, 9001), Some(8973));
        assert_eq!(discovery_ceiling(v6, 9000), Some(8952));
        assert_eq!(discovery_ceiling(v4, 65_536), Some(65_000));
    }

    #[test]
    fn no_interface_holds_loopback_or_unspecified_for_this_purpose() {
        assert_eq!(interface_mtu(IpAddr::V4(Ipv4Addr::LOCALHOST)), None);
        assert_eq!(interface_mtu(IpAddr::V4(Ipv4Addr::UNSPECIFIED)), None);
        // TEST-NET-1 is never assigned to a host.
        assert_eq!(
            interface_mtu(IpAddr::V4(Ipv4Addr::new(192, 0, 2, 77))),
            None
        );
    }
}
