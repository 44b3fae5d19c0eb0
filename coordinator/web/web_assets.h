#ifndef AIDN_COORDINATOR_WEB_WEB_ASSETS_H_
#define AIDN_COORDINATOR_WEB_WEB_ASSETS_H_

// The web UI's pages, compiled into the coordinator (embed_assets.cmake
// writes them into web_assets.cc at build time from coordinator/web/): a
// fresh install serves them with nothing else installed but Debian's
// libjs-chart.js for the charts.

#include <string_view>

namespace aidn::coordinator::web {

struct WebAsset {
  std::string_view path;  // "/", "/app.js", "/style.css", ...
  std::string_view content_type;
  std::string_view body;
};

// Null for a path that is none of them.
const WebAsset* FindWebAsset(std::string_view path);

}  // namespace aidn::coordinator::web

#endif  // AIDN_COORDINATOR_WEB_WEB_ASSETS_H_
