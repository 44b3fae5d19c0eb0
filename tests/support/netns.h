#ifndef AIDN_TESTS_SUPPORT_NETNS_H_
#define AIDN_TESTS_SUPPORT_NETNS_H_

// A network namespace joined to the host by a veth pair on a private /30,
// made with ip(8) for a test or benchmark that cuts a node's network: what
// runs under Exec() sees only its end of the link, whose state SetLink
// changes. Removed (with the pair) on destruction. Needs root.

#include <memory>
#include <string>
#include <vector>

namespace aidn::testing {

class Netns {
 public:
  // Null, with the reason in `why`, when it cannot be made here (no root,
  // a container without network namespaces). Names and addresses come from
  // the process id, so concurrent tests do not collide.
  static std::unique_ptr<Netns> Create(std::string* why);
  ~Netns();
  Netns(const Netns&) = delete;
  Netns& operator=(const Netns&) = delete;

  // The host's end of the link: where a server the namespace must reach listens.
  const std::string& host_ip() const { return host_ip_; }
  // What runs a command inside the namespace (a prefix for argv).
  std::vector<std::string> Exec() const { return {"ip", "netns", "exec", name_}; }
  // The namespace's end of the link down (its packets go nowhere), or up.
  bool SetLink(bool up);

 private:
  Netns() = default;
  std::string name_, host_if_, ns_if_, host_ip_, ns_ip_;
};

}  // namespace aidn::testing

#endif  // AIDN_TESTS_SUPPORT_NETNS_H_
