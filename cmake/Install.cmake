# `cmake --install` and the Debian package (CPack): the binaries, the Python
# client, systemd units with their flag files, examples and docs.
#   cmake -S . -B build-pkg -DCMAKE_INSTALL_PREFIX=/usr -DAIDN_ENABLE_CUDA=OFF ...
#   cmake --build build-pkg && (cd build-pkg && cpack -G DEB)
# scripts/package.sh does exactly that.
include(GNUInstallDirs)

# Where the installed files refer to each other. Under /usr, configuration
# and state go to /etc and /var (the FHS), not under the prefix.
if(CMAKE_INSTALL_PREFIX STREQUAL "/usr")
  set(AIDN_CONF_DIR /etc/aidn)
else()
  set(AIDN_CONF_DIR ${CMAKE_INSTALL_FULL_SYSCONFDIR}/aidn)
endif()
set(AIDN_BIN_DIR ${CMAKE_INSTALL_FULL_BINDIR})
set(AIDN_DOC_DIR ${CMAKE_INSTALL_FULL_DOCDIR})
set(AIDN_STATE_DIR /var/lib/aidn)
set(AIDN_SYSTEMD_UNIT_DIR lib/systemd/system CACHE STRING
    "where the systemd units go, relative to the prefix")

install(TARGETS aidn-coordinator aidn-worker aidnctl RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
if(TARGET aidn-worker-gpu)
  install(TARGETS aidn-worker-gpu RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
endif()

foreach(unit aidn-coordinator aidn-worker)
  configure_file(${PROJECT_SOURCE_DIR}/deploy/systemd/${unit}.service.in
                 ${CMAKE_BINARY_DIR}/deploy/systemd/${unit}.service @ONLY)
  install(FILES ${CMAKE_BINARY_DIR}/deploy/systemd/${unit}.service
          DESTINATION ${AIDN_SYSTEMD_UNIT_DIR})
endforeach()
install(FILES deploy/systemd/aidn.sysusers DESTINATION lib/sysusers.d RENAME aidn.conf)
install(FILES deploy/systemd/coordinator.flags deploy/systemd/worker.flags
        DESTINATION ${AIDN_CONF_DIR})

install(DIRECTORY examples/ DESTINATION ${CMAKE_INSTALL_DATADIR}/aidn/examples
        PATTERN "__pycache__" EXCLUDE)
install(DIRECTORY deploy/ DESTINATION ${CMAKE_INSTALL_DATADIR}/aidn/deploy
        PATTERN "*.in" EXCLUDE)
install(FILES README.md DESTINATION ${CMAKE_INSTALL_DOCDIR})
install(DIRECTORY docs/ DESTINATION ${CMAKE_INSTALL_DOCDIR})

# The Debian package. Library dependencies come from dpkg-shlibdeps; the
# user, units and state dirs from the maintainer scripts in deploy/debian.
set(CPACK_PACKAGE_NAME aidn)
set(CPACK_PACKAGE_VENDOR "aidn")
set(CPACK_PACKAGE_CONTACT "aidn maintainers <aidn@localhost>")
set(CPACK_PACKAGE_DESCRIPTION_SUMMARY "distributed training service: coordinator, workers and aidnctl")
string(CONCAT CPACK_PACKAGE_DESCRIPTION
    "A coordinator daemon that gang-schedules training jobs and runs their rendezvous, worker\n"
    "daemons that run one process per rank, and aidnctl. Units: aidn-coordinator.service,\n"
    "aidn-worker.service; flags in /etc/aidn.")
set(CPACK_DEBIAN_FILE_NAME DEB-DEFAULT)
set(CPACK_DEBIAN_PACKAGE_SECTION science)
set(CPACK_DEBIAN_PACKAGE_SHLIBDEPS ON)
set(CPACK_DEBIAN_PACKAGE_DEPENDS "python3, python3-grpcio, python3-protobuf, adduser")
# YAML specs and fast checkpoint manifests in the Python client; the dataset
# the examples train on.
set(CPACK_DEBIAN_PACKAGE_RECOMMENDS
  "python3-yaml, python3-crc32c, dataset-fashion-mnist, libjs-chart.js")
set(CPACK_DEBIAN_PACKAGE_CONTROL_EXTRA
    ${PROJECT_SOURCE_DIR}/deploy/debian/postinst
    ${PROJECT_SOURCE_DIR}/deploy/debian/prerm
    ${PROJECT_SOURCE_DIR}/deploy/debian/postrm
    ${PROJECT_SOURCE_DIR}/deploy/debian/conffiles)
set(CPACK_DEBIAN_PACKAGE_CONTROL_STRICT_PERMISSION ON)
set(CPACK_GENERATOR DEB)
include(CPack)
