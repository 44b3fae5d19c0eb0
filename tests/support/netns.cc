#include "tests/support/netns.h"

#include <unistd.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "tests/support/process.h"

namespace aidn::testing {

std::unique_ptr<Netns> Netns::Create(std::string* why) {
  const int id = static_cast<int>(getpid() % 100000);
  auto ns = std::unique_ptr<Netns>(new Netns());
  ns->name_ = absl::StrCat("aidn-part-", id);
  ns->host_if_ = absl::StrCat("ap", id, "h");
  ns->ns_if_ = absl::StrCat("ap", id, "n");
  const std::string net = absl::StrCat("10.233.", id % 250, ".");
  ns->host_ip_ = net + "1";
  ns->ns_ip_ = net + "2";
  const std::vector<std::vector<std::string>> setup = {
      {"ip", "netns", "add", ns->name_},
      {"ip", "link", "add", ns->host_if_, "type", "veth", "peer", "name", ns->ns_if_},
      {"ip", "link", "set", ns->ns_if_, "netns", ns->name_},
      {"ip", "addr", "add", ns->host_ip_ + "/30", "dev", ns->host_if_},
      {"ip", "link", "set", ns->host_if_, "up"},
      {"ip", "netns", "exec", ns->name_, "ip", "addr", "add", ns->ns_ip_ + "/30", "dev",
       ns->ns_if_},
      {"ip", "netns", "exec", ns->name_, "ip", "link", "set", ns->ns_if_, "up"},
      {"ip", "netns", "exec", ns->name_, "ip", "link", "set", "lo", "up"},
  };
  for (const std::vector<std::string>& argv : setup) {
    const CommandResult r = RunCommand(argv);
    if (r.exit_code != 0) {
      *why = absl::StrCat(absl::StrJoin(argv, " "), ": ", r.err, r.out);
      return nullptr;  // the destructor removes what was made
    }
  }
  return ns;
}

Netns::~Netns() {
  RunCommand({"ip", "link", "del", host_if_});
  RunCommand({"ip", "netns", "del", name_});
}

bool Netns::SetLink(bool up) {
  std::vector<std::string> argv = Exec();
  argv.insert(argv.end(), {"ip", "link", "set", ns_if_, up ? "up" : "down"});
  return RunCommand(argv).exit_code == 0;
}

}  // namespace aidn::testing
