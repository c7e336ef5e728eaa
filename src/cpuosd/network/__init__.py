"""Per-sandbox networking: network namespaces, veth pairs, the daemon's nftables table, egress
policy, DNS and proxy, and the record of what the firewall drops."""
