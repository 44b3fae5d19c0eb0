# cmake -DSOURCE_DIR=<coordinator/web> -DOUTPUT=<web_assets.cc> -P embed_assets.cmake
# Writes the web UI's files into a C++ source as raw string literals.
# path|media type|file (each served as UTF-8).
set(assets
  "/|text/html|index.html"
  "/common.js|text/javascript|common.js"
  "/jobs.js|text/javascript|jobs.js"
  "/cluster.js|text/javascript|cluster.js"
  "/job.js|text/javascript|job.js"
  "/app.js|text/javascript|app.js"
  "/style.css|text/css|style.css")
set(out "// Generated from coordinator/web/ by embed_assets.cmake; do not edit.\n")
string(APPEND out "#include \"coordinator/web/web_assets.h\"\n\n")
string(APPEND out "namespace aidn::coordinator::web {\nnamespace {\n\n")
string(APPEND out "constexpr WebAsset kAssets[] = {\n")
foreach(asset IN LISTS assets)
  string(REPLACE "|" ";" fields "${asset}")
  list(GET fields 0 path)
  list(GET fields 1 type)
  list(GET fields 2 file)
  file(READ "${SOURCE_DIR}/${file}" body)
  string(FIND "${body}" ")aidnweb\"" clash)
  if(NOT clash EQUAL -1)
    message(FATAL_ERROR "${file} contains the raw string delimiter )aidnweb\"")
  endif()
  string(APPEND out "    {\"${path}\", \"${type}; charset=utf-8\", R\"aidnweb(${body})aidnweb\"},\n")
endforeach()
string(APPEND out "};\n\n}  // namespace\n\n")
string(APPEND out "const WebAsset* FindWebAsset(std::string_view path) {\n")
string(APPEND out "  for (const WebAsset& asset : kAssets) {\n")
string(APPEND out "    if (asset.path == path) return &asset;\n  }\n  return nullptr;\n}\n\n")
string(APPEND out "}  // namespace aidn::coordinator::web\n")
# Only a changed text touches the output (no rebuild otherwise).
if(EXISTS "${OUTPUT}")
  file(READ "${OUTPUT}" old)
  if(old STREQUAL out)
    return()
  endif()
endif()
file(WRITE "${OUTPUT}" "${out}")
